// mantissa: the command-line program of the Mantissa engine.
#include <iostream>
#include <string>
#include <vector>

#include "mantissa/cli.h"

int main(int argc, char** argv) {
  return mantissa::cli::run_command(std::vector<std::string>(argv + 1, argv + argc), std::cin,
                                    std::cout, std::cerr);
}
