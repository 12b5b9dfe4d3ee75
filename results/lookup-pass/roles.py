"""Diagnostic (from the repository root: python results/lookup-pass/roles.py CHECKPOINT): how much of a quantized
Whisper's teacher-forced KLD comes from the token lookup vs the output projection of the tied matrix. Variants of
one checkpoint: as is; fp lookup (decoder input embedding from F16, head quantized); fp head (projection F16, lookup
quantized). Dev split, 200 utterances; means over positions."""
import copy, sys, json
import numpy as np, torch
from torch import nn
from tarq_deploy.models.loader import load_whisper
from tarq_deploy.models.from_checkpoint import load_dequantized_whisper
from tarq_deploy.data.corpus import load_corpus, load_audio
from tarq_deploy.evaluate.teacher_forced import TeacherForcedScorer, score_utterances

torch.set_num_threads(2)
ckpt = sys.argv[1]
ref_model, processor, gc = load_whisper("packaged:base")
ref_model = ref_model.float().eval()
fp_table = ref_model.model.decoder.embed_tokens.weight.detach().clone()

def variant(kind):
    model, p, g = load_dequantized_whisper(ckpt)
    q_table = model.proj_out.weight.detach().clone()
    if kind == "fp-lookup":
        model.model.decoder.embed_tokens = nn.Embedding.from_pretrained(fp_table.clone(), freeze=True)
        model.proj_out.weight = nn.Parameter(q_table, requires_grad=False)
    elif kind == "fp-head":
        model.model.decoder.embed_tokens = nn.Embedding.from_pretrained(q_table, freeze=True)
        model.proj_out.weight = nn.Parameter(fp_table.clone(), requires_grad=False)
    return TeacherForcedScorer((model.eval(), p, g))

utts = load_corpus("corpora/synth/eval.jsonl")
data = [(u.id, load_audio(u), u.text) for u in utts]
ref = TeacherForcedScorer((ref_model, processor, gc))
models = {k: variant(k) for k in ("as-is", "fp-lookup", "fp-head")}
res = score_utterances(ref, models, data)
for name, rows in res.items():
    out = {}
    for g in ("rare", "common"):
        n = sum(r.counts[g] for r in rows)
        out[g] = round(sum(r.sums[f"kld_{g}"] for r in rows) / n, 4)
    print(name, json.dumps(out))
