#!/bin/bash
# The GPU verify graph's device check (issue 16 item 3), on the device machine in the project root, after the
# payload parts of ../shared/gpu/make_payload.sh were copied to /tmp/p (see ../shared/gpu/README.md):
#   run  carry: []  command: bash scripts/gpu_check.sh 2>&1 | tee $OUT/log   timeout ~540
# Steps (each with its own time limit, most important first; STEPS="pass verify bench test peer" picks; DEADLINE=S
# shortens every limit so the whole script ends within S seconds of its start, skipping what no longer fits):
#   export fp16 -> /tmp/e16 (kept while the machine stays warm), pass ms by q (GPU graph with and without
#   CUDA graphs, contract graph), verify (greedy identity n-gram vs plain) and bench on ort-cuda, the
#   pytest GPU tests, the transformers peer benchmark. Results also land in $OUT. VERIFY_LIMIT=N verifies the first N
#   prompts of each workload. The peer step skips transformers' torch.compile mode unless PEER_ARGS="" (on the device
#   image, transformers 5.17, it failed: "accessing tensor output of CUDAGraphs that has been overwritten", and the
#   step did not finish in its 240 s). Not in the default list: loose (verify and bench with --no-shape-invariant: what the
#   shape-invariant mode costs and what it buys).
#   Not in the default list: qad (issue 18) exports fp32 -> /tmp/e32, builds NVFP4 weight-only rank 128 with
#   quantization-aware distillation on the GPU (QAD_STEPS, QAD_BATCH, QAD_SAMPLES) and evals it vs fp32:
#     STEPS=qad QAD_STEPS=600 bash scripts/gpu_check.sh 2>&1 | tee $OUT/log   (timeout ~590)
#   serve (issue 46; in the default list, last): `speccompile serve --backend ort-cuda` on an fp16 export with a 32-slot
#   GPU slot form (/tmp/e16s, `--batch-slots 32`), driven by benchmarks/serve_load.py: 1 vs 8 and 1 vs 32 concurrent
#   streams, each run printing its throughput ratio and its TTFT p50 ratio (streams-N over streams-1, same run),
#   and the device memory in use: benchmarks/gpu_weights_memory.py first (MiB the target's GPU graph, its slotted form
#   over the shared weights and a slotted session with its own copy each add), then each run's peak (nvidia-smi).
#   servetree (issue 46; in the default list, after serve): the same with `--drafter suffix` (trees), which batches in
#   the tree form target.ort-cuda-tree-slots.onnx (onnxruntime-gpu >= 1.28): 8 streams, mismatches vs 1 stream.
#   tree (issue 46; not in the default list): a single stream drafting trees (`--drafter suffix`) on ort-cuda runs
#   slot 0 of the tree form (/tmp/e16 has it: --batch-slots 8 by default): verify (identical, the graph), then bench
#   against the contract graph that ran it before (`--contract-graph`: plain and drafted passes there).
#   and modelopt (issue 18): ModelOpt's PyTorch NVFP4 weight-only quantization (CUDA only in ModelOpt 0.47) of the
#   same fp32 export, scored like ours (benchmarks/modelopt_torch_compare.py); its wheels: bash
#   scripts/modelopt_payload.sh here, then carry .dev/modelopt.tar:  STEPS=modelopt bash scripts/gpu_check.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"pass verify bench test peer serve servetree"}
LIMIT=${LIMIT:-6}; NEW=${NEW:-128}; SC_ARGS=${SC_ARGS:-}; DEADLINE=${DEADLINE:-0}
VERIFY_ARGS=${VERIFY_LIMIT:+--limit $VERIFY_LIMIT}
lim() {  # a step's time limit: $1 seconds, or what is left before DEADLINE (1: no time left)
  local want=$1 left
  if [ "$DEADLINE" -gt 0 ]; then left=$((DEADLINE - SECONDS - 5)); [ "$left" -lt "$want" ] && want=$left; fi
  [ "$want" -lt 10 ] && want=1; echo "$want"
}
if [ ! -d /tmp/site/onnxruntime ]; then
  mkdir -p /tmp/site /tmp/pay && cat /tmp/p/part.* | tar -x -C /tmp/pay && tar -xJf /tmp/pay/ort.tar.xz -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/pay/*.whl || { echo "payload incomplete: $(ls /tmp/p 2>&1)"; exit 3; }
fi
export PYTHONPATH=$PWD:/tmp/site
export LD_LIBRARY_PATH=$(python3 -c "import glob,os,site;print(':'.join(sorted({os.path.dirname(p) for b in site.getsitepackages() for p in glob.glob(os.path.join(b,'nvidia','**','lib*.so*'),recursive=True)})))"):${LD_LIBRARY_PATH:-}
mkdir -p /tmp/scbin && printf '#!/bin/bash\nexec python3 -c "import sys; from speccompile.cli import main; sys.argv[0]=\\"speccompile\\"; main()" "$@"\n' > /tmp/scbin/sc && chmod +x /tmp/scbin/sc
export PATH=/tmp/scbin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" | tee -a "$OUT/gpu.txt"
NEEDS_FP16=$(case "$STEPS" in *pass*|*verify*|*bench*|*test*|*peer*|*serve*) echo 1 ;; *) echo 0 ;; esac)  # qad/modelopt: fp32 only
if [ "$NEEDS_FP16" = 1 ] && [ ! -f /tmp/e16/target.ort-cuda.onnx ]; then
  start=$SECONDS; timeout 150 sc export smollm2-135m --dtype fp16 --out /tmp/e16 --force > "$OUT/export16.txt" 2>&1
  echo "export fp16: $((SECONDS - start)) s"; tail -n 3 "$OUT/export16.txt"
fi
[ "$NEEDS_FP16" = 0 ] || [ -f /tmp/e16/target.ort-cuda.onnx ] || { echo "fp16 export has no target.ort-cuda.onnx"; exit 4; }
export32() {  # the fp32 export the quantization steps start from
  [ -f /tmp/e32/manifest.json ] && return
  local start=$SECONDS; timeout 150 sc export smollm2-135m --out /tmp/e32 --force > "$OUT/export32.txt" 2>&1
  echo "export fp32: $((SECONDS - start)) s"
}
W="--workload benchmarks/workloads/copy.jsonl --workload benchmarks/workloads/chat.jsonl"
identical() {  # one line from a verify --json file: how many prompts were identical, and the first differences
  python3 -c "import json;j=json.load(open('$1'));b=[(p['id'],p['first_difference']) for p in j['prompts'] if not p['identical']];print('$2 identical',len(j['prompts'])-len(b),'/',len(j['prompts']),b[:8])" 2>&1 | tail -1
}
for step in $STEPS; do
  echo "== $step ($SECONDS s)"
  if [ "$DEADLINE" -gt 0 ] && [ "$(lim 60)" -lt 10 ]; then echo "skipped: DEADLINE $DEADLINE s reached"; continue; fi
  case $step in
    pass) timeout $(lim 120) python3 benchmarks/gpu_pass_times.py --artifact /tmp/e16 --json 2>&1 | tee "$OUT/pass_times.txt" ;;
    verify) timeout $(lim 200) sc verify /tmp/e16 --backend ort-cuda $W $VERIFY_ARGS --max-tokens $NEW --drafter ngram $SC_ARGS --json > "$OUT/verify16.json" 2> "$OUT/verify16.err"
      identical "$OUT/verify16.json" fp16 ;;
    tree) timeout $(lim 150) sc verify /tmp/e16 --backend ort-cuda $W $VERIFY_ARGS --max-tokens $NEW --drafter suffix $SC_ARGS --json > "$OUT/verifytree.json" 2> "$OUT/verifytree.err"
      identical "$OUT/verifytree.json" "fp16 suffix trees"; python3 -c "import json;print('graph',json.load(open('$OUT/verifytree.json'))['graph'])" 2>&1 | tail -1
      for graph in "" --contract-graph; do
        timeout $(lim 150) sc bench /tmp/e16 --backend ort-cuda $W --limit $LIMIT --max-tokens $NEW --drafter suffix $graph $SC_ARGS > "$OUT/benchtree$graph.txt" 2>&1
        echo "bench suffix trees ${graph:-tree form}:"; tail -n 6 "$OUT/benchtree$graph.txt"
      done ;;
    loose) timeout $(lim 150) sc verify /tmp/e16 --backend ort-cuda $W $VERIFY_ARGS --max-tokens $NEW --drafter ngram --no-shape-invariant $SC_ARGS --json > "$OUT/verify16_loose.json" 2> "$OUT/verify16_loose.err"
      identical "$OUT/verify16_loose.json" "fp16 --no-shape-invariant"
      timeout $(lim 150) sc bench /tmp/e16 --backend ort-cuda $W --limit $LIMIT --max-tokens $NEW --drafter ngram --no-shape-invariant $SC_ARGS > "$OUT/bench16_loose.txt" 2>&1
      tail -n 12 "$OUT/bench16_loose.txt" ;;
    bench) timeout $(lim 200) sc bench /tmp/e16 --backend ort-cuda $W --limit $LIMIT --max-tokens $NEW --drafter ngram $SC_ARGS > "$OUT/bench16.txt" 2>&1
      tail -n 12 "$OUT/bench16.txt" ;;
    test) if python3 -m pytest --version > /dev/null 2>&1; then
        timeout $(lim 120) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graph.py tests/test_shared_weights.py::test_cuda_sessions_share_the_weights_in_place \
          tests/test_qad.py::test_torch_graph_computes_what_onnxruntime_computes tests/test_qad.py::test_the_stored_graph_is_the_trained_student 2>&1 | tail -n 15 | tee "$OUT/pytest_gpu.txt"
      else echo "no pytest on this machine: skipped"; fi ;;
    peer) timeout $(lim 240) python3 benchmarks/gpu_peer_hf.py --artifact /tmp/e16 --limit ${PEER_LIMIT:-3} --max-tokens $NEW \
        ${PEER_ARGS---no-compile} 2>&1 | tee "$OUT/peer_hf.txt" | tail -n 16 ;;
    serve) if [ ! -f /tmp/e16s/target.ort-cuda-tree-slots.onnx ]; then
        start=$SECONDS; timeout $(lim 150) sc export smollm2-135m --dtype fp16 --batch-slots 32 --out /tmp/e16s --force > "$OUT/export16s.txt" 2>&1
        echo "export fp16 with 32 slots: $((SECONDS - start)) s"; tail -n 2 "$OUT/export16s.txt"
      fi
      [ -f /tmp/e16s/target.ort-cuda-slots.onnx ] || { echo "no GPU slot form in /tmp/e16s"; continue; }
      timeout $(lim 90) python3 benchmarks/gpu_weights_memory.py /tmp/e16s 2>&1 | tee "$OUT/weights_memory.txt"
      for streams in 8 32; do
        (while sleep 1; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0; done) > "$OUT/serve_mem_$streams.txt" 2>/dev/null &
        sampler=$!
        timeout $(lim 200) python3 benchmarks/serve_load.py /tmp/e16s $W --limit ${SERVE_LIMIT:-8} --max-tokens $NEW \
          --streams $streams --passes 2 --requests 0 --json -- --backend ort-cuda --max-concurrency 32 > "$OUT/serve_$streams.json" 2> "$OUT/serve_$streams.err"
        kill $sampler 2>/dev/null
        echo "streams $streams: device memory used while serving, peak $(sort -n "$OUT/serve_mem_$streams.txt" | tail -1) MiB"
        python3 -c "import json;j=json.load(open('$OUT/serve_$streams.json'));print('streams $streams:',j['ratios'],[(p['phase'],p['tok_per_s'],p['ttft_p50_s'],p['mismatches']) for p in j['phases']])" 2>&1 | tail -1
      done ;;
    servetree) [ -f /tmp/e16s/target.ort-cuda-tree-slots.onnx ] || { echo "no GPU tree slot form in /tmp/e16s (run the serve step first)"; continue; }
      # trees batched in the tree form (suffix drafter: trees with no head to export); mismatches: streams-8 vs streams-1
      timeout $(lim 200) python3 benchmarks/serve_load.py /tmp/e16s $W --limit ${SERVE_LIMIT:-8} --max-tokens $NEW \
        --streams 8 --passes 2 --requests 0 --json -- --backend ort-cuda --max-concurrency 32 --drafter suffix > "$OUT/servetree.json" 2> "$OUT/servetree.err"
      python3 -c "import json;j=json.load(open('$OUT/servetree.json'));print('tree streams 8:',j['ratios'],[(p['phase'],p['tok_per_s'],p['mismatches']) for p in j['phases']])" 2>&1 | tail -1
      grep -m2 -i "tree\|batch" "$OUT/servetree.err" ;;
    qad) export32
      start=$SECONDS
      timeout ${QAD_LIMIT:-480} sc build /tmp/e32 --onnx-only --fp4 --weight-only --low-rank 128 --quantize-lm-head --threads 16 \
        --qad-device cuda --qad-steps ${QAD_STEPS:-600} --qad-batch ${QAD_BATCH:-8} --qad-samples ${QAD_SAMPLES:-512} \
        --force --out /tmp/q4 > "$OUT/qad_build.txt" 2>&1
      echo "build with QAD: $((SECONDS - start)) s"; grep -E "QAD" "$OUT/qad_build.txt" | tail -n 6
      timeout 240 sc eval /tmp/q4 --reference /tmp/e32 --threads 16 --json > "$OUT/qad_eval.json" 2>&1
      python3 -c "import json;j=json.load(open('$OUT/qad_eval.json'));print({k:j[k] for k in j if k!='workloads'})" 2>&1 | tail -c 600 ;;
    modelopt) if [ ! -d /tmp/mosite/modelopt ]; then
        [ -f .dev/modelopt.tar ] || { echo "no .dev/modelopt.tar: run bash scripts/modelopt_payload.sh here and carry it"; continue; }
        mkdir -p /tmp/mow /tmp/mosite && tar -xf .dev/modelopt.tar -C /tmp/mow &&
          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mosite /tmp/mow/*.whl || { echo "ModelOpt install failed"; continue; }
      fi
      export32
      ours=$([ -f /tmp/q4/manifest.json ] && echo "--ours nvfp4-weight-only-lr128-qad=/tmp/q4")
      PYTHONPATH=$PYTHONPATH:/tmp/mosite timeout ${MO_LIMIT:-420} python3 benchmarks/modelopt_torch_compare.py /tmp/e32 \
        --modelopt-python python3 --device cuda --work /tmp/mot --threads 16 $ours \
        ${MO_CONFIGS:---config W4A16_NVFP4_CFG --config W4A16_NVFP4_CFG:awq_lite --config W4A16_NVFP4_CFG:awq_clip --config NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG+weight-only --config NVFP4_FOUR_OVER_SIX_CFG+weight-only} \
        2>&1 | tee "$OUT/modelopt_torch.txt" | tail -n 12 ;;
    *) echo "unknown step $step (pass verify bench test peer serve servetree tree loose qad modelopt)" ;;
  esac
done
