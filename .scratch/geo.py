import json, math, sys
cells = []
for f in sys.argv[1:]:
    cells += json.load(open(f))["cells"]
logs = []; rows = []
for c in cells:
    r = c["results"]
    others = {k: v["us"] for k, v in r.items() if k in ("eager","cudagraph","compile","compile-ro") and v.get("us")}
    bo = min(others, key=others.get)
    a = r["fxfuse-auto"]["us"]
    logs.append(math.log(others[bo] / a))
    rows.append((c["label"], bo, round(others[bo],1), round(a,1), round(others[bo]/a,2)))
for row in rows: print(*row)
print("geomean", round(math.exp(sum(logs)/len(logs)),3), "n", len(logs), "min", min(r[-1] for r in rows))
