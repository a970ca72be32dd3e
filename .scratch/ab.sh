#!/usr/bin/env bash
# A/B of the timing order on host-bound cells
OUT=${OUT:-.out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 FXFUSE_CACHE_DIR=/tmp/fxfuse-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || cat /tmp/install.log
B="python -m benchmarks.mlp --layers 8 --hidden 128,512 --batch 1,16,64 --no-heatmap --out /tmp/o"
row() { python3 - "$1" <<'PY'
import json,glob,os,sys
f=sorted(glob.glob("/tmp/o/*/*.json"), key=os.path.getmtime)[-1]
d=json.load(open(f))
print(sys.argv[1], " | ".join(f"{c['params']['hidden']}x{c['params']['batch']}: " + " ".join(f"{k}={v['us']:.1f}" for k,v in c["results"].items() if v.get("us")) for c in d["cells"]))
PY
}
ALL=eager,cudagraph,compile,compile-ro,fxfuse,fxfuse-auto
for i in 1 2; do
$B --tools $ALL --order sequential >/dev/null 2>&1; row "seq-all"
$B --tools $ALL --order interleaved >/dev/null 2>&1; row "int-all"
$B --tools cudagraph,fxfuse,fxfuse-auto --order interleaved >/dev/null 2>&1; row "int-nocompile"
$B --tools fxfuse --order sequential >/dev/null 2>&1; row "seq-fxfuse-only"
done 2>&1 | tee $OUT/ab.txt
