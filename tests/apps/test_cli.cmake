# Runs the mantissa program as a user would and checks its output and exit status.
# Invoked by CTest as: cmake -DMANTISSA=<path> -DWORK=<dir> -P test_cli.cmake
if(NOT MANTISSA)
  message(FATAL_ERROR "pass -DMANTISSA=<path to the mantissa program>")
endif()
set(failures 0)

# expect(<name> <expected exit code> <regex for stdout> <regex for stderr> ARGS...)
function(expect name code out_re err_re)
  execute_process(COMMAND ${MANTISSA} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  INPUT_FILE ${STDIN_FILE})
  set(ok TRUE)
  if(NOT rc EQUAL code)
    set(ok FALSE)
  endif()
  if(NOT out MATCHES "${out_re}")
    set(ok FALSE)
  endif()
  if(NOT err MATCHES "${err_re}")
    set(ok FALSE)
  endif()
  if(NOT ok)
    message(SEND_ERROR "FAILED ${name}: exit ${rc} (want ${code})\n--- stdout:\n${out}--- stderr:\n${err}")
    math(EXPR f "${failures} + 1")
    set(failures ${f} PARENT_SCOPE)
  else()
    message(STATUS "ok ${name}")
  endif()
endfunction()

set(WORK ${CMAKE_CURRENT_BINARY_DIR}/cli_test_work)
file(MAKE_DIRECTORY ${WORK})
set(STDIN_FILE ${WORK}/empty.txt)
file(WRITE ${STDIN_FILE} "")

expect(peak 0 "^fp32 fma peak: [0-9.]+ GFLOP/s on 2 threads \\([0-9.]+ on 1; " "^$" peak --threads 2 --seconds 0.01)
expect(peak_bad_threads 2 "" "--threads must be an integer from 1 to 1024 \\(got 'x'\\)" peak --threads x)
expect(peak_bad_option 2 "" "unknown option '--fast' for peak" peak --fast)
expect(formats 0 "e4m3 +1/4/3 +1 +448 +0.015625 +0.001953125 +0.125.*conversion path" "^$" formats)
expect(cast_f16 0 "^1.1 1.09960938 0x3c66\n65520 inf 0x7c00\n-0 -0 0x8000\nnan nan 0x7e00\n$" "^$"
       cast --to f16 1.1 65520 -0 nan)
expect(cast_negative_values 0 "^-1.5 -1.5 0xbe00\n-inf -inf 0xfc00\n$" "^$" cast --to f16 -1.5 -inf)
expect(cast_bf16 0 "^1.00390625 1 0x3f80\n3.4e38 inf 0x7f80\n$" "" cast --to=bf16 1.00390625 3.4e38)
expect(cast_e4m3 0 "^464 448 0x7e\n465 nan 0x7f\n0.001 0.001953125 0x01\n$" ""
       cast --to e4m3 464 465 0.001)
expect(cast_e4m3_saturate 0 "^1000 448 0x7e\n-inf -448 0xfe\n$" "" cast --to e4m3 --saturate 1000 -inf)
expect(cast_e5m2 0 "^57344 57344 0x7b\n61440 inf 0x7c\n$" "" cast --to e5m2 57344 61440)
expect(cast_hex_and_subnormal 0 "^0x1p-24 5.96046448e-08 0x0001\n$" "" cast --to f16 0x1p-24)
expect(cast_after_double_dash 0 "^-2 -2 0xc000\n$" "" cast --to f16 -- -2)

# Standard input: one value per line, blank lines skipped.
set(STDIN_FILE ${WORK}/values.txt)
file(WRITE ${STDIN_FILE} "1\n\n  2.5  \n0.1\n")
expect(cast_stdin 0 "^1 1 0x3c00\n2.5 2.5 0x4100\n0.1 0.0999755859 0x2e66\n$" "^$" cast --to f16)
file(WRITE ${STDIN_FILE} "1\nabc\n")
expect(cast_stdin_bad_line 2 "^1 1 0x3c00\n$" "'abc' \\(standard input, line 2\\) is not a number" cast --to f16)

# Stochastic rounding: reproducible for a seed; both neighbours appear over many draws.
set(STDIN_FILE ${WORK}/empty.txt)
set(many)
foreach(i RANGE 63)
  list(APPEND many 1.0003)
endforeach()
execute_process(COMMAND ${MANTISSA} cast --to f16 --stochastic --seed 9 ${many} OUTPUT_VARIABLE a)
execute_process(COMMAND ${MANTISSA} cast --to f16 --stochastic --seed 9 ${many} OUTPUT_VARIABLE b)
execute_process(COMMAND ${MANTISSA} cast --to f16 --stochastic --seed 10 ${many} OUTPUT_VARIABLE c)
if(NOT a STREQUAL b OR a STREQUAL c OR NOT a MATCHES "0x3c00" OR NOT a MATCHES "0x3c01")
  message(SEND_ERROR "FAILED cast_stochastic: not reproducible per seed, or not both neighbours\n${a}")
  math(EXPR failures "${failures} + 1")
else()
  message(STATUS "ok cast_stochastic")
endif()

# Bad input: one clear line on stderr, exit status 2.
expect(bad_value 2 "" "error: 'x1' is not a number" cast --to f16 x1)
expect(bad_format 2 "" "unknown format 'f8' for --to; use f16, bf16, e4m3 or e5m2" cast --to f8 1)
expect(not_a_narrow_format 2 "" "unknown format 'f32'" cast --to f32 1)
expect(missing_to 2 "" "cast needs --to" cast 1)
expect(unknown_option 2 "" "unknown option '--fast' for cast" cast --to f16 --fast 1)
expect(bad_seed 2 "" "--seed '-3' is not a non-negative integer" cast --to f16 --stochastic --seed -3 1)
expect(seed_without_stochastic 2 "" "--seed only applies with --stochastic" cast --to f16 --seed 3 1)
expect(unknown_command 2 "" "unknown command 'trian'" trian)
expect(formats_extra_argument 2 "" "formats takes no arguments" formats --json)
expect(no_command 2 "usage: mantissa" "" )
expect(help 0 "commands:" "" --help)
expect(cast_help 0 "--stochastic" "" cast --help)

# ---- mantissa train / eval (synthetic data: no files needed) ----
set(TRAIN_SMALL --dataset synthetic --synthetic-size 96 --batch-size 16 --image-size 16 --no-progress)
expect(train_help 0 "--metrics-json FILE" "" train --help)
expect(train_synthetic 0 "epoch 1: loss [0-9.]+, train accuracy [0-9.]+%, [0-9.]+ s, [0-9.]+ images/s\ntest accuracy: [0-9.]+% \\(24 images\\)"
       "" train --model lenet5 ${TRAIN_SMALL} --save ${WORK}/lenet.safetensors --metrics-json ${WORK}/m.json)
expect(train_progress_bar 0 "" "epoch 1/1 100%\\|#+\\| 6/6 \\[.*it/s.*loss=.*acc=" train --model lenet5 --dataset synthetic --synthetic-size 96 --batch-size 16 --image-size 16 --no-eval)
expect(train_print_model 0 "\\(conv1\\): Conv2d\\(1, 6, kernel_size=\\(5, 5\\), stride=\\(1, 1\\), bias=False\\)" "" train --model lenet5 ${TRAIN_SMALL} --max-steps 1 --no-eval --print-model)
# Data-parallel settings in one process: accepted, and named once as changing nothing here.
expect(train_dp_flags_one_process 0 "note: --allreduce-dtype, --zero act between the ranks of a data-parallel job \\(mpirun -n N, N > 1\\); this run has one process, so they change nothing\n" "" train --model lenet5 ${TRAIN_SMALL} --max-steps 1 --no-eval --allreduce-dtype fp16 --zero 1)
expect(eval_checkpoint 0 "^lenet5: test accuracy [0-9.]+% \\(24 images\\), mean loss [0-9.]+\n$" "" eval --checkpoint ${WORK}/lenet.safetensors)
expect(eval_needs_checkpoint 2 "" "needs --checkpoint FILE" eval)
expect(eval_missing_file 2 "" "nothing.safetensors" eval --checkpoint ${WORK}/nothing.safetensors)
expect(train_unknown_flag 2 "" "^mantissa: error: unknown option '--epoch' for 'mantissa train'; run 'mantissa train --help' for the list\n$" train --epoch 2)
expect(train_unknown_model 2 "" "^mantissa: error: unknown model 'vgg' \\(choose --model from: tutorial-cnn, lenet5" train --model vgg)
expect(train_bad_number 2 "" "--lr 'fast' is not a number" train --lr fast)
expect(train_bad_batch 2 "" "--batch-size '0' is not an integer >= 1" train --batch-size 0)
expect(train_missing_data 2 "" "data directory /nonexistent of fashion-mnist does not exist \\(install Debian's dataset-fashion-mnist" train --data-dir /nonexistent)
expect(train_resume_other_model 2 "" "is a checkpoint of lenet5, not of tutorial-cnn \\(pass --model lenet5" train --model tutorial-cnn ${TRAIN_SMALL} --resume ${WORK}/lenet.safetensors)
file(WRITE ${WORK}/broken.safetensors "not a checkpoint")
expect(train_corrupt_init 2 "" "broken.safetensors" train --model lenet5 ${TRAIN_SMALL} --init-from ${WORK}/broken.safetensors)
expect(train_bad_metrics_dir 2 "" "directory /nonexistent-dir does not exist" train --model lenet5 ${TRAIN_SMALL} --max-steps 1 --no-eval --metrics-json /nonexistent-dir/m.json)
# Two outputs of one run naming one file are refused before anything is written, the numerics
# report's page (written beside it) included; so is a page path that is a directory.
expect(train_outputs_clash 2 "" "--save ${WORK}/clash.out and --metrics-json ${WORK}/clash.out name the same file: one would replace the other" train --model lenet5 ${TRAIN_SMALL} --max-steps 1 --no-eval --save ${WORK}/clash.out --metrics-json ${WORK}/clash.out)
expect(train_numerics_page_clash 2 "" "--report ${WORK}/num_clash.html and --numerics-report's page ${WORK}/num_clash.html name the same file" train --model lenet5 ${TRAIN_SMALL} --max-steps 1 --no-eval --numerics-report ${WORK}/num_clash.json --report ${WORK}/num_clash.html)
file(MAKE_DIRECTORY ${WORK}/num_dir.html)
expect(train_numerics_page_dir 2 "" "--numerics-report's page ${WORK}/num_dir.html is a directory" train --model lenet5 ${TRAIN_SMALL} --max-steps 1 --no-eval --numerics-report ${WORK}/num_dir.json)
expect(memory_outputs_clash 2 "" "--json ${WORK}/mem_clash and --html ${WORK}/mem_clash name the same file" memory --model lenet5 --batch-size 4 --json ${WORK}/mem_clash --html ${WORK}/mem_clash)
foreach(f clash.out num_clash.json num_clash.html num_dir.json mem_clash)
  if(EXISTS ${WORK}/${f})
    message(SEND_ERROR "FAILED outputs_clash: ${WORK}/${f} was written")
  endif()
endforeach()
expect(train_no_bias_correction 0 "epoch 1:" "" train --model lenet5 ${TRAIN_SMALL} --max-steps 2 --no-eval --optimizer adam --no-bias-correction --metrics-json ${WORK}/nobc.json)
file(READ ${WORK}/nobc.json nobc)
if(NOT nobc MATCHES "\"bias_correction\": false" OR NOT nobc MATCHES "\"optimizer\": \"adam\"")
  message(SEND_ERROR "FAILED train_no_bias_correction_metrics:\n${nobc}")
  math(EXPR failures "${failures} + 1")
endif()
# Output paths are checked before training: nothing printed, nothing trained.
expect(train_bad_save_dir 2 "^$" "--save /nonexistent-dir/c.safetensors: directory /nonexistent-dir does not exist" train --model lenet5 ${TRAIN_SMALL} --save /nonexistent-dir/c.safetensors)
file(READ ${WORK}/m.json metrics)
if(NOT metrics MATCHES "\"step_losses\": \\[" OR NOT metrics MATCHES "\"peak_memory_bytes\"" OR NOT metrics MATCHES "\"test_accuracy\": 0\.")
  message(SEND_ERROR "FAILED train_metrics_json:\n${metrics}")
  math(EXPR failures "${failures} + 1")
else()
  message(STATUS "ok train_metrics_json")
endif()

# ---- precision ----
set(TRAIN_CNN --model tutorial-cnn --dataset synthetic --synthetic-size 96 --batch-size 16 --image-size 24 --no-progress --test-limit 16)
expect(train_precision_mixed 0 "precision 16-mixed: parameters f32, input f32, autocast to f16 by op lists.*loss scaling dynamic \\(initial 65536.*autocast: conv2d in conv1: f32 -> f16 \\(lower_precision\\).*autocast: group_norm in norm: f16 -> f32 \\(fp32\\).*loss scale [0-9]+, [0-9]+ steps skipped"
       "" train ${TRAIN_CNN} --precision 16-mixed --autocast-log --max-steps 3)
expect(train_precision_true 0 "precision 16-true: parameters f16, input f16, autocast off.*optimizer state f16/bf16.*stochastic rounding"
       "" train ${TRAIN_CNN} --precision 16-true --stochastic-rounding --keep-fp32 norm,fc2 --max-steps 2)
expect(train_precision_o2_static 0 "precision O2: parameters f32, read as f16 \\(normalization layers f32\\), input f16.*master weights f32 \\(the parameters\\).*loss scaling static 1024.*loss scale 1024"
       "" train ${TRAIN_CNN} --precision O2 --loss-scaling 1024 --max-steps 2)
expect(train_precision_unknown 2 "" "^mantissa: error: unknown precision 'fp8' \\(choose --precision from: 32-true, O0, 32.32, 16-mixed, bf16-mixed, O1, O2, 16-true, bf16-true, O3, 16.16, 16.32, fp8-hybrid, fp8-e4m3\\)
$" train --precision fp8)
expect(train_precision_half_type 2 "" "--precision 16-mixed fixes the 16-bit type to f16" train --precision 16-mixed --half-type bf16)
expect(train_loss_scaling_bad 2 "" "--loss-scaling 'lots' is not valid \\(use none, dynamic, or a positive number" train --loss-scaling lots)
expect(train_state_type_bad 2 "" "--second-moment-type 'fp8' is not a type \\(use fp32, fp16 or bf16\\)" train --second-moment-type fp8)
expect(train_keep_fp32_unknown 2 "" "nrom" train ${TRAIN_CNN} --precision 16-true --keep-fp32 nrom)
file(WRITE ${WORK}/lower.txt "linear\nconv9d\n")
expect(train_autocast_list_bad 2 "" "unknown op 'conv9d' in the lower-precision list" train ${TRAIN_CNN} --precision 16-mixed --autocast-lower-list ${WORK}/lower.txt)
expect(train_mixed_metrics 0 "" "" train ${TRAIN_CNN} --precision bf16-mixed --max-steps 2 --metrics-json ${WORK}/bf16.json)
file(READ ${WORK}/bf16.json bf16m)
if(NOT bf16m MATCHES "\"precision\": \"bf16-mixed\"" OR NOT bf16m MATCHES "\"loss_scale\": null")
  message(SEND_ERROR "FAILED train_mixed_metrics_json:\n${bf16m}")
  math(EXPR failures "${failures} + 1")
endif()

# ---- memory budget: the seed's "out of memory in FP32, fits in FP16" ----
set(TRAIN_BUDGET --dataset synthetic --synthetic-size 48 --max-steps 2 --no-progress --no-eval --memory-budget 48MiB)
expect(train_budget_fp32_oom 3 "" "^mantissa: out of memory on cpu: cannot allocate .* of the 48.00 MiB budget.*largest holders" train ${TRAIN_BUDGET})
expect(train_budget_fp16_fits 0 "peak memory [0-9.]+ MiB" "" train ${TRAIN_BUDGET} --precision 16-true)
expect(train_budget_bad 2 "" "--memory-budget '12XB' is not a size" train --memory-budget 12XB)

# ---- the IPU guide's pipeline levers ----
set(TRAIN_PIPE --dataset synthetic --synthetic-size 192 --image-size 16 --model lenet5 --no-progress --no-eval)
expect(train_pipeline 0 "epoch 1: loss .*waited [0-9.]+ s for data \\(4.12 KiB a batch\\), host [0-9]+ us a step" ""
       train ${TRAIN_PIPE} --batch-size 16 --gradient-accumulation 3 --accumulation-reduction running --device-iterations 2 --output-mode all --eight-bit-io --async-dataloader --workers 2 --precision 16-true)
expect(train_accumulation_bad 2 "" "--accumulation-reduction 'avg' is not valid \\(use mean, running or sum\\)" train --accumulation-reduction avg)
expect(train_accumulation_too_many 2 "" "an epoch has 16 batches, fewer than the 17 micro-batches of one optimizer step" train ${TRAIN_PIPE} --gradient-accumulation 17)
expect(train_workers_bad 2 "" "--workers '0' is not an integer >= 1" train --workers 0)
expect(train_detect_anomaly 4 "" "^mantissa: step 2: anomaly in forward: linear in module 'fc1' produced [0-9]+ inf/nan values \\(f16 \\(12, 120\\).*input 1: f16 \\(120, 16\\).*HINT: .*--keep-fp32 fc1"
       train ${TRAIN_PIPE} --precision 16-true --optimizer sgd --lr 1e5 --detect-anomaly)
expect(train_numerics_report 0 "numerics report: .*num.json and .*num.html \\(1 step\\); suggested loss scale [0-9]+" ""
       train ${TRAIN_PIPE} --max-steps 3 --precision 16-mixed --numerics-report ${WORK}/num.json)
expect(train_loss_scale_from_report 0 "loss scaling dynamic \\(initial [0-9]+, .*initial loss scale from numerics report .*num.json" ""
       train ${TRAIN_PIPE} --max-steps 1 --precision 16-mixed --loss-scale-init from:${WORK}/num.json)
expect(train_loss_scale_from_nothing 2 "" "--loss-scale-init from: needs a file name" train --loss-scale-init from:)
expect(train_loss_scale_from_other 2 "" "bf16.json: not a numerics report \\(no number at suggested_loss_scale.scale\\)"
       train --precision 16-mixed --loss-scale-init from:${WORK}/bf16.json)
# Options that would act on nothing with the others are refused, naming the conflict.
expect(train_beta_under_sgd 2 "" "^mantissa: error: --beta1 applies to Adam and AdamW, not to --optimizer sgd \\(drop --beta1, or use --optimizer adam or adamw\\)\n$"
       train --optimizer sgd --beta1 0.8)
expect(train_scale_option_unscaled 2 "" "--loss-scale-min applies to loss scaling, which --precision bf16-mixed does not use"
       train --precision bf16-mixed --loss-scale-min 1)
expect(train_scale_init_static 2 "" "--loss-scale-init applies to a dynamic loss scale, and --loss-scaling 1024 is a static one"
       train --precision 16-mixed --loss-scaling 1024 --loss-scale-init 4096)
expect(train_rounding_nothing 2 "" "--stochastic-rounding has nothing to round: --precision 16-mixed keeps the parameters and the optimizer state in FP32"
       train --precision 16-mixed --stochastic-rounding)
expect(train_prefetch_sync 2 "" "--prefetch applies to the asynchronous loader" train --prefetch 4)
expect(train_async_no_prefetch 2 "" "--async-dataloader with --prefetch 0 lets the workers make nothing ahead" train --async-dataloader --prefetch 0)
expect(train_period_final 2 "" "--output-return-period applies to --output-mode every, not final"
       train --device-iterations 4 --output-return-period 2)
expect(train_nesterov_adam 2 "" "--nesterov applies to SGD, not to --optimizer adamw" train --nesterov)
# A resume refuses what breaks exactness and names what changes the run.
expect(train_resume_first 0 "" "" train ${TRAIN_PIPE} --max-steps 2 --save ${WORK}/ck.safetensors)
expect(train_resume_seed 2 "" "ck.safetensors was trained with --seed 0, not 3: a bit-exact continuation needs the same batches \\(pass --seed 0 to resume it\\)"
       train ${TRAIN_PIPE} --max-steps 3 --resume ${WORK}/ck.safetensors --seed 3)
expect(train_resume_lr 0 "resuming .*ck.safetensors at step 2 with settings that change the run from there: --lr 0.0005 \\(the checkpoint's: 0.001\\)\n" ""
       train ${TRAIN_PIPE} --max-steps 3 --resume ${WORK}/ck.safetensors --lr 5e-4)
expect(train_profile 0 "profile: 3 steps, [0-9.]+ ms a step.*\n  forward +conv1 +Conv2d +[0-9.]+ +[0-9.]+% +1\n.*  backward +fc1 +linear .*  in-backward +fc1.weight +sgd .*  \\(loop\\)" ""
       train ${TRAIN_PIPE} --max-steps 3 --optimizer sgd --profile)
expect(train_profile_after_backward 0 "  backward +fc1 +linear .*  optimizer +fc1.weight +sgd .*  \\(loop\\)" ""
       train ${TRAIN_PIPE} --max-steps 3 --optimizer sgd --profile --no-update-in-backward)
expect(train_profile_value 2 "" "--profile takes no value" train --profile=yes)
# ---- mantissa memory ----
set(MEM memory --model lenet5 --image-size 16 --batch-size 8 --threads 2)
expect(memory_two_precisions 0 "memory of one training step: lenet5, batch 8, 16x16.*total at the peak .*ratio to 32-true: 16-true [0-9.]+%.*largest holders at the peak, 32-true:\n  fc2 " ""
       ${MEM} --precision 32-true --precision 16-true --json ${WORK}/mem.json --html ${WORK}/mem.html)
file(READ ${WORK}/mem.html mem_html)
file(READ ${WORK}/mem.json mem_json)
if(NOT mem_html MATCHES "<svg.*<svg.*<svg" OR NOT mem_json MATCHES "\"timeline\": \\[")
  message(SEND_ERROR "FAILED memory_files")
  math(EXPR failures "${failures} + 1")
endif()
# Kahan compensation: optimizer state grows by 2 bytes a parameter (AdamW's BF16 state: 4).
expect(memory_kahan 0 "optimizer_state +91\\.43 KiB" "" ${MEM} --precision bf16-true --kahan)
expect(memory_kahan_fp32 2 "" "--kahan with --precision 32-true, whose parameters are FP32" ${MEM} --kahan)
expect(memory_over_budget 3 "32-true: does NOT fit in the budget of 100.00 KiB" "" ${MEM} --memory-budget 100KiB)
expect(memory_bad_precision 2 "" "unknown precision '17-true'" ${MEM} --precision 17-true)
# --ranks N measures the step with the threads each of N ranks on this host takes (its cores / N),
# unless --threads says.
cmake_host_system_information(RESULT cores QUERY NUMBER_OF_LOGICAL_CORES)
math(EXPR rank_threads "${cores} / 2")
if(rank_threads LESS 1)
  set(rank_threads 1)
endif()
expect(memory_ranks_threads 0 "lenet5, batch 8, 16x16, adamw, ${rank_threads} threads? a rank of 2 on this host\n.*per rank of 2 ranks" ""
       memory --model lenet5 --image-size 16 --batch-size 8 --ranks 2)
expect(memory_ranks_threads_given 0 "adamw, 3 threads a rank of 2 on this host\n" "" memory --model lenet5 --image-size 16 --batch-size 8 --ranks 2 --threads 3)
expect(memory_bad_html 2 "" "--html /nonexistent-dir/m.html: directory /nonexistent-dir does not exist" ${MEM} --html /nonexistent-dir/m.html)
# ---- mantissa advise ----
set(ADV advise --model lenet5 --dataset synthetic --synthetic-size 64 --image-size 16 --batch-size 16 --steps 3 --threads 2)
expect(advise_clean_bill 0 "precision 16-mixed \\(fp16\\), from 3 FP32 steps.*\n  fc1 .*loss scales that keep the gradients representable: 2\\^-?[0-9]+ to 2\\^[0-9]+\n.*clean bill: 16-mixed as it is.*\n  mantissa train --model lenet5 --dataset synthetic --image-size 16 --synthetic-size 64 --batch-size 16 --precision 16-mixed --loss-scaling dynamic\nverify .*recommended \\(16-mixed\\): 2 steps, final loss [0-9.]+, mean gap to 32-true [0-9.e-]+\n"
       "calibrating: 3 FP32 steps of lenet5" ${ADV} --precision 16-mixed --verify 2 --json ${WORK}/advise.json --html ${WORK}/advise.html)
file(READ ${WORK}/advise.json adv_json)
file(READ ${WORK}/advise.html adv_html)
if(NOT adv_json MATCHES "\"recommendation\": {\n +\"command\": \"mantissa train --model lenet5" OR NOT adv_html MATCHES "<svg.*<svg")
  message(SEND_ERROR "FAILED advise_files")
  math(EXPR failures "${failures} + 1")
endif()
expect(advise_kahan 0 "would be lost: --kahan.*--precision bf16-true --loss-scaling none --kahan\n" "" ${ADV} --precision bf16-true --lr 1e-6)
expect(advise_needs_precision 2 "" "'mantissa advise' needs --precision P" ${ADV})
expect(advise_fp32 2 "" "--precision 32-true keeps everything in FP32: nothing to advise \\(name a 16-bit precision" ${ADV} --precision 32-true)
expect(advise_bad_precision 2 "" "unknown precision '17-mixed'" ${ADV} --precision 17-mixed)
expect(advise_bad_steps 2 "" "--steps '0' is not an integer >= 1" ${ADV} --precision 16-mixed --steps 0)
expect(advise_bad_init 2 "" "/nonexistent.safetensors" ${ADV} --precision 16-mixed --init-from /nonexistent.safetensors)
expect(advise_bad_json 2 "" "--json /nonexistent-dir/a.json: directory /nonexistent-dir does not exist" ${ADV} --precision 16-mixed --json /nonexistent-dir/a.json)
expect(advise_unknown_option 2 "" "unknown option '--epochs' for 'mantissa advise'" ${ADV} --precision 16-mixed --epochs 2)
# Ctrl-C, SIGTERM (what Slurm, Kubernetes and systemd send before killing) and SIGHUP: the run
# stops at a step boundary, saves its checkpoint and metrics, and exits with 128 + the signal.
find_program(SH sh)
string(REPLACE ";" " " TRAIN_PIPE_LINE "${TRAIN_PIPE}")
foreach(sig_code INT:130 TERM:143 HUP:129)
  string(REPLACE ":" ";" sig_code "${sig_code}")
  list(GET sig_code 0 sig)
  list(GET sig_code 1 code)
  file(REMOVE ${WORK}/sig.safetensors ${WORK}/sig.json)
  execute_process(COMMAND ${SH} -c "\"${MANTISSA}\" train ${TRAIN_PIPE_LINE} --synthetic-size 100000 --image-size 32 --async-dataloader --save '${WORK}/sig.safetensors' --metrics-json '${WORK}/sig.json' & pid=$!; sleep 2; kill -${sig} $pid; wait $pid; echo \"exit $?\""
                  OUTPUT_VARIABLE sig_out ERROR_VARIABLE sig_err)
  if(NOT sig_out MATCHES "interrupted at step [0-9]+, checkpoint saved to .*sig.safetensors.*exit ${code}\n$"
     OR NOT EXISTS ${WORK}/sig.safetensors OR NOT EXISTS ${WORK}/sig.json)
    message(SEND_ERROR "FAILED train_sig${sig} (want exit ${code}, a checkpoint and metrics):\n${sig_out}\n${sig_err}")
    math(EXPR failures "${failures} + 1")
  else()
    message(STATUS "ok train_sig${sig}")
  endif()
endforeach()

if(failures GREATER 0)
  message(FATAL_ERROR "${failures} CLI check(s) failed")
endif()
