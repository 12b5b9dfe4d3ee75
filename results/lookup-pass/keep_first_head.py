"""The second pass's checkpoint with the first pass's head (and so tied lookup) lattice put back, copied code for
code. Usage: python results/lookup-pass/keep_first_head.py FIRST SECOND OUT"""
import sys
from tarq_deploy.checkpoint import load_checkpoint, save_checkpoint
old, new, out = sys.argv[1:4]
a, b = load_checkpoint(old), load_checkpoint(new)
name = "proj_out.weight"
assert name in b.quantized, list(b.quantized)[-3:]
b.quantized[name] = a.quantized[name]
b.metadata["experiment"] = "head (and tied lookup) taken from " + old
save_checkpoint(b, out)
print("saved", out)
