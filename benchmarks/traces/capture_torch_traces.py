"""Captures the two PyTorch memory traces in this folder (run on the H200 with torch 2.11.0+cu130
and transformers from the device image; random weights, no downloads):

    python3 benchmarks/traces/capture_torch_traces.py   # with OUT=<folder> set

- torch_gpt2_generate: GPT-2 small (fp16) generating 16-64 tokens for 6 requests of batch 1-8 and
  16-256 prompt tokens (HF generate: the KV cache grows by concatenation every step).
- torch_bert_serve: BERT-base (fp16) forward passes for 60 requests of batch 1-32 x 16-512 tokens.

(The two ``live_*_arena.csv.gz`` files here are not from this script: they are poolkeeper's own
allocation logs of the arena arm of the H200 real-model runs, ``bash benchmarks/run_h200.sh
live_logs``, which ``poolkeeper replay`` and ``benchmarks/stream_lag_replay.py`` read.)

Each trace is the snapshot dict ``torch.cuda.memory._snapshot()`` returns (what
``_dump_snapshot`` pickles), gzip-compressed; ``*.stats.json`` holds the caching allocator's own
peaks (``torch.cuda.memory_stats``) for the same run. ``requested_bytes.all.peak`` equals the
replay's peak live; ``reserved_bytes.all.peak`` is what PyTorch held.
"""
import torch, random, json, os, gzip
from transformers import GPT2Config, GPT2LMHeadModel, BertConfig, BertModel
out = os.environ['OUT']; random.seed(0); torch.manual_seed(0)
def cap(name, fn):
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(context=None, max_entries=400000)
    with torch.no_grad():
        fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    import pickle
    with gzip.open(f'{out}/{name}.pickle.gz', 'wb') as f:
        pickle.dump(snap, f)
    st = torch.cuda.memory_stats()
    info = {k: st.get(k) for k in ('allocated_bytes.all.peak', 'reserved_bytes.all.peak', 'requested_bytes.all.peak', 'allocation.all.allocated', 'segment.all.allocated')}
    info['trace_entries'] = len(snap['device_traces'][0])
    print(name, json.dumps(info))
    with open(f'{out}/{name}.stats.json', 'w') as f:
        json.dump(info, f)
def gpt2():
    m = GPT2LMHeadModel(GPT2Config()).half().cuda().eval()
    for r in range(6):
        b = random.choice([1, 2, 4, 8]); n = random.randint(16, 256)
        ids = torch.randint(0, 50257, (b, n), device='cuda')
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=random.randint(16, 64), min_new_tokens=16, do_sample=False, pad_token_id=0)
def bert():
    m = BertModel(BertConfig()).half().cuda().eval()
    for r in range(60):
        b = random.randint(1, 32); n = random.randint(16, 512)
        m(torch.randint(0, 30522, (b, n), device='cuda'))
print(torch.__version__, torch.cuda.get_device_name(0))
cap('torch_gpt2_generate', gpt2)
cap('torch_bert_serve', bert)
