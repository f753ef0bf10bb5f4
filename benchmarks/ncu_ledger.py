"""Stall ledger of an Nsight Compute source page: the SASS instructions with the most warp-stall samples.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_ledger.py sass.csv [TOP]

Prints the sample share of each stall reason, then the TOP instructions (default 40) with their
share, the running total and their two largest stall reasons (study_small_ce.sh runs it on the H200).
"""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
# find header
hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
hdr = rows[hi]; data = [dict(zip(hdr, r)) for r in rows[hi+1:] if len(r) == len(hdr)]
stall_cols = [c for c in hdr if c.startswith("stall_") and "Not Issued" not in c]
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:  # empty or non-numeric cells
        return 0.0
tot = sum(num(d["Warp Stall Sampling (All Samples)"]) for d in data)
print("instructions", len(data), "samples", tot)
agg = collections.Counter()
for d in data:
    for c in stall_cols: agg[c] += num(d[c])
print("by reason:", [(k, f"{v/tot:.1%}") for k, v in agg.most_common(10)])
data.sort(key=lambda d: -num(d["Warp Stall Sampling (All Samples)"]))
cum = 0
for d in data[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
    s = num(d["Warp Stall Sampling (All Samples)"]); cum += s
    top = sorted(((num(d[c]), c[6:]) for c in stall_cols), reverse=True)[:2]
    print(f"{d['Address']:>6} {s/tot:6.1%} {cum/tot:6.1%} {d['Source'][:70]:70s} {top[0][1]}:{top[0][0]:.0f} {top[1][1]}:{top[1][0]:.0f}")
