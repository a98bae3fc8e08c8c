"""A small transformer trained N steps under PyTorch's own allocator and under pyalloc: the same
losses (same seeds, deterministic kernels), with peak reserved memory and step time of both.

Each allocator runs in a fresh child process (PyTorch takes its allocator before CUDA starts); the
children alternate (native, pyalloc, native, pyalloc, ... for --rounds rounds). Reported: whether
every loss matched bit for bit, the largest difference, peak reserved bytes (native:
torch.cuda.max_memory_reserved; pyalloc: pyalloc.max_memory_reserved, which counts all of
pyalloc's segments for the device), and the median step time of each with pyalloc / native.

Run on the GPU machine:  python bench/torch_train_compare.py [--steps 200] [--rounds 3] [--json out.json]
                                                       [--pyalloc-cap-mib N]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
kind, steps = sys.argv[1], int(sys.argv[2])
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
if kind == "pyalloc":
    import pyalloc, pyalloc.torch as pt
    pt.install()
    cap = int(os.environ.get("TRAIN_PYALLOC_CAP_MIB", "0"))   # --pyalloc-cap-mib
    if cap:
        pyalloc.set_per_process_memory_fraction(cap * 2**20 / torch.cuda.get_device_properties(0).total_memory, 0)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.enable_flash_sdp(False)          # the math attention kernels: deterministic
torch.backends.cuda.enable_mem_efficient_sdp(False)
torch.backends.cuda.enable_math_sdp(True)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
vocab, d_model, seq, batch = 2000, 256, 128, 32

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)
    def forward(self, tokens):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

model = Model().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
gen = torch.Generator(device="cpu").manual_seed(1)
data = torch.randint(0, vocab, (steps, batch, seq + 1), generator=gen)
losses, times = [], []
for step in range(steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = data[step].cuda(non_blocking=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    times.append(time.perf_counter() - t0)
peak = pyalloc.max_memory_reserved(0) if kind == "pyalloc" else torch.cuda.max_memory_reserved(0)
print(json.dumps({"kind": kind, "losses": losses, "peak_reserved": peak,
                  "step_s": sorted(times[10:])[len(times[10:]) // 2]}))
"""


def run_child(kind, steps):
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(steps)], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    if out.returncode != 0:
        raise SystemExit(f"{kind} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--pyalloc-cap-mib", type=int, default=0,
                        help="cap pyalloc's device memory at this many MiB "
                             "(pyalloc.set_per_process_memory_fraction; native runs uncapped)")
    args = parser.parse_args(argv)
    os.environ["TRAIN_PYALLOC_CAP_MIB"] = str(args.pyalloc_cap_mib)
    runs = {"native": [], "pyalloc": []}
    for r in range(args.rounds):
        for kind in (("native", "pyalloc") if r % 2 == 0 else ("pyalloc", "native")):
            runs[kind].append(run_child(kind, args.steps))
    reference = runs["native"][0]["losses"]
    every = [run["losses"] for kind in runs for run in runs[kind]]
    max_diff = max(abs(a - b) for losses in every for a, b in zip(losses, reference))
    identical = all(losses == reference for losses in every)
    native_identical = all(run["losses"] == reference for run in runs["native"])
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    peak = {k: max(r["peak_reserved"] for r in v) for k, v in runs.items()}
    result = {"steps": args.steps, "rounds": args.rounds, "losses_identical": identical,
              "native_runs_identical": native_identical,
              "max_loss_difference": max_diff, "first_loss": reference[0], "last_loss": reference[-1],
              "peak_reserved": peak, "peak_reserved_pyalloc_over_native": peak["pyalloc"] / peak["native"],
              "step_s": step, "step_time_pyalloc_over_native": step["pyalloc"] / step["native"]}
    print(f"{args.steps} steps x {args.rounds} rounds: losses identical {identical} "
          f"(max difference {max_diff:.3g}; loss {reference[0]:.4f} -> {reference[-1]:.4f}; "
          f"native runs identical among themselves: {native_identical})")
    print(f"peak reserved: native {peak['native'] / 2**20:.1f} MiB, pyalloc {peak['pyalloc'] / 2**20:.1f} MiB "
          f"(pyalloc/native {result['peak_reserved_pyalloc_over_native']:.3f})")
    print(f"median step: native {step['native'] * 1e3:.2f} ms, pyalloc {step['pyalloc'] * 1e3:.2f} ms "
          f"(pyalloc/native {result['step_time_pyalloc_over_native']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
