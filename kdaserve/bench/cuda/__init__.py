"""`kdaserve bench cuda`: kdaserve's CUDA path checked and timed on one GPU, in one run.

Sections (each its own key; one that fails records its error and the run goes on):

- `correctness`: for both bundled models (the K3 demo, the Kimi Linear demo) a few text prompts
  generated greedily together, fp32, on the device and on the CPU (`cpu_reference`; with
  `--device cpu` the CPU run takes the torch forward): `greedy_identical_cuda_vs_cpu`
  and, where they differ, the first differing position per prompt (fp32 reductions differ
  between devices, so this is reported, not asserted); which KDA backend the registry picked on
  the device and how many times fla's Triton chunk kernel ran in the device generation.
- `kda_op`: fla-core's chunk_kda (what the registry calls on CUDA) against kdaserve's torch
  reference `kdaserve.ops.kda.kda_chunk` and fla's naive recurrence on random inputs of the
  demos' KDA shape (max abs error of outputs and final states), and both chunked forms timed on
  one long prefill.
- `throughput`: per model and dtype (fp32, bf16): single-stream decode (128-token prompt, 256
  greedy tokens: TPOT median, decode tok/s), batch 32 (32 requests x 128 in / 128 out: output
  tok/s end to end, and decode tok/s from the median step), prefill tok/s of one 2,048-token
  prompt (one engine step).
- `long`: the random hybrid of `kdaserve bench long` (kdaserve/bench/long.py) at 1k, 16k and
  128k tokens of context: prefill tok/s (chunked, 8,192-token steps), decode TPOT after it, and
  `tpot_ratio_128k_1k`.
- `spec`: speculative decoding with each demo's bundled DSpark draft, batch 1, greedy, against
  plain decode (`kdaserve.bench.spec_measure.measure`: speedup, acceptance, identical outputs).

Timings: warm-ups first (Triton compiles and autotunes per shape), every engine step ends in a
device-to-host copy of the logits (a synchronisation), explicit torch.cuda.synchronize around
op timings, medians of `--repeats` runs. On a fresh machine Triton compiles and autotunes
fla's kernels on first use, per head size: about two of the six minutes of a cold run on an
H200 (docs/benchmarks.md); about three minutes once its cache is warm. `--budget-s` bounds the
run: a section, model or context not started when it is spent is skipped (and says so).
`--tiny` shrinks every size to a few tokens, so the whole bench runs on a CPU in seconds.

Modules: `workload` (models, sizes), `driver` (building and stepping engines), one module per
section (`correctness`, `kda_op`, `throughput`, `long_context`, `spec_decode`), and `cli` (flags,
the run, the summary). Nothing here imports the server: the GPU machines lack FastAPI.
"""
