"""Record a small but real PyTorch allocator trace, for pyalloc's shipped example and its tests.

Run on a machine with a CUDA GPU and PyTorch (written for torch 2.11, CUDA 13, H200):

    python3 tools/record_example_trace.py examples/small_train.pickle.gz
    python3 tools/record_example_trace.py /tmp/split.pickle.gz --alloc-conf max_split_size_mb:64

The workload is a small GPT-style transformer (4 layers, 384 wide, 6 heads, vocabulary 5000)
trained with AdamW under bf16 autocast for 10 steps, with the batch size and the sequence length
changing every step (irregular values, as bucketed real data gives), so that the allocator sees
request sizes that are not powers of two, frees, splits and reuse: about ten thousand events. Memory history is switched on (enabled="all", context=None: no
stack traces, which keeps the file small) before the first CUDA allocation, so the trace holds
every allocator event of the run and replaying it must reproduce PyTorch's peaks exactly.

It writes two files:
  OUT                 the snapshot (torch.cuda.memory._snapshot()), a gzip-compressed pickle
  OUT without .pickle.gz + .json
                      torch.cuda.memory_stats() figures at the end of the run, in the format of
                      tests/data/torch-peaks.jsonl (peak_reserved, peak_allocated,
                      peak_requested, num_device_alloc, num_alloc_retries, final_reserved, the
                      event counts by action), plus the setting, torch version and device.
The allocator setting comes from --alloc-conf (else PYTORCH_CUDA_ALLOC_CONF as set); it is put
into the environment before torch initialises CUDA, which is when PyTorch reads it.
"""
import argparse
import collections
import gzip
import json
import os
import pickle
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="snapshot path, ending in .pickle.gz")
    p.add_argument("--alloc-conf", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF for the run (default: the environment's)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--max-entries", type=int, default=200_000,
                   help="history ring buffer size; the run must stay below it (default 200000)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.out.endswith(".pickle.gz"):
        p.error(f"the output path must end in .pickle.gz, got {args.out!r}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def build_model(torch, vocab, width, layers, heads, max_len):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, width)
            self.pos = nn.Embedding(max_len, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            n = idx.shape[1]
            pos = torch.arange(n, device=idx.device)
            mask = torch.triu(torch.full((n, n), float("-inf"), device=idx.device), diagonal=1)
            x = self.tok(idx) + self.pos(pos)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln(x))

    return TinyGPT()


def train_step(torch, model, opt, vocab, batch, seq, device):
    """One AdamW step under bf16 autocast on random tokens of shape (batch, seq)."""
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    target = torch.randint(0, vocab, (batch, seq), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), target.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv=None):
    args = parse_args(argv)
    if args.alloc_conf is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")

    import torch

    if not torch.cuda.is_available():
        sys.exit("record_example_trace.py needs a CUDA GPU")
    torch.manual_seed(args.seed)
    device = torch.device("cuda", 0)
    # History on before anything is allocated on the device: the trace then starts at an empty
    # allocator and replay can reproduce every figure.
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=args.max_entries)

    vocab, width, layers, heads, max_len = 5000, 384, 4, 6, 640
    model = build_model(torch, vocab, width, layers, heads, max_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    # Batch sizes and sequence lengths change every step, as in real training with bucketed
    # sequences: requests of many sizes, and blocks freed at one size and reused at another.
    shapes = [(8, 137), (13, 251), (5, 509), (11, 333), (7, 421), (16, 97), (6, 613), (9, 287),
              (12, 199), (4, 577)]
    started = time.perf_counter()
    for step in range(args.steps):
        batch, seq = shapes[step % len(shapes)]
        train_step(torch, model, opt, vocab, batch, seq, device)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started

    snapshot = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled=None)

    trace = snapshot["device_traces"][0]
    if len(trace) >= args.max_entries:
        sys.exit(f"the trace filled its ring buffer ({len(trace)} entries): raise --max-entries")
    with gzip.open(args.out, "wb", compresslevel=9) as f:
        pickle.dump(snapshot, f, protocol=4)

    actions = collections.Counter(e["action"] for e in trace)
    peaks = {
        "workload": "small_train", "tag": conf or "default",
        "conf": conf, "secs": round(seconds, 2), "events": len(trace), "actions": dict(actions),
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "peak_requested": stats["requested_bytes.all.peak"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": stats["num_ooms"],
        "final_reserved": stats["reserved_bytes.all.current"],
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0), "steps": args.steps, "seed": args.seed,
    }
    json_path = args.out[:-len(".pickle.gz")] + ".json"
    with open(json_path, "w") as f:
        json.dump(peaks, f, indent=1)
        f.write("\n")
    print(json.dumps(peaks))
    print(f"wrote {args.out} ({os.path.getsize(args.out):,} bytes) and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
