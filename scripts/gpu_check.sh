#!/bin/bash
# The GPU verify graph's device check (issue 16 item 3), on the device machine in the project root, after the
# payload parts of ../shared/gpu/make_payload.sh were copied to /tmp/p (see ../shared/gpu/README.md):
#   run  carry: []  command: bash scripts/gpu_check.sh 2>&1 | tee $OUT/log   timeout ~540
# Steps (each with its own time limit, most important first; STEPS="pass verify bench test peer" picks):
#   export fp16 -> /tmp/e16 (kept while the machine stays warm), pass ms by q (GPU graph with and without
#   CUDA graphs, contract graph), verify (greedy identity n-gram vs plain) and bench on ort-cuda, the
#   pytest GPU tests, the transformers peer benchmark. Results also land in $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"pass verify bench test peer"}
LIMIT=${LIMIT:-6}; NEW=${NEW:-128}; SC_ARGS=${SC_ARGS:-}
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
if [ ! -f /tmp/e16/target.ort-cuda.onnx ]; then
  start=$SECONDS; timeout 150 sc export smollm2-135m --dtype fp16 --out /tmp/e16 --force > "$OUT/export16.txt" 2>&1
  echo "export fp16: $((SECONDS - start)) s"; tail -n 3 "$OUT/export16.txt"
fi
[ -f /tmp/e16/target.ort-cuda.onnx ] || { echo "fp16 export has no target.ort-cuda.onnx"; exit 4; }
W="--workload benchmarks/workloads/copy.jsonl --workload benchmarks/workloads/chat.jsonl"
for step in $STEPS; do
  echo "== $step"
  case $step in
    pass) timeout 120 python3 benchmarks/gpu_pass_times.py --artifact /tmp/e16 --json 2>&1 | tee "$OUT/pass_times.txt" ;;
    verify) timeout 200 sc verify /tmp/e16 --backend ort-cuda $W --max-tokens $NEW --drafter ngram $SC_ARGS --json > "$OUT/verify16.json" 2>&1
      python3 -c "import json;j=json.load(open('$OUT/verify16.json'));b=[(p['id'],p['first_difference']) for p in j['prompts'] if not p['identical']];print('fp16 identical',len(j['prompts'])-len(b),'/',len(j['prompts']),b)" 2>&1 | tail -1 ;;
    bench) timeout 200 sc bench /tmp/e16 --backend ort-cuda $W --limit $LIMIT --max-tokens $NEW --drafter ngram $SC_ARGS > "$OUT/bench16.txt" 2>&1
      tail -n 12 "$OUT/bench16.txt" ;;
    test) if python3 -m pytest --version > /dev/null 2>&1; then
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graph.py 2>&1 | tail -n 15 | tee "$OUT/pytest_gpu.txt"
      else echo "no pytest on this machine: skipped"; fi ;;
    peer) timeout 240 python3 benchmarks/gpu_peer_hf.py --artifact /tmp/e16 --limit ${PEER_LIMIT:-3} --max-tokens $NEW 2>&1 | tee "$OUT/peer_hf.txt" | tail -n 16 ;;
    *) echo "unknown step $step (pass verify bench test peer)" ;;
  esac
done
