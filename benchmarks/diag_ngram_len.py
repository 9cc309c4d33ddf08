"""Diagnosis for the server benchmark: one request, off vs n-gram k = 4, at max_model_len 320 and 1024 (engine in process)."""
import sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks')); sys.path.insert(0, str(ROOT))
import jax, gc
import jspec, common
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine
prompt = common.humaneval_prompts(0, 1)[0]
import argparse
ap = argparse.ArgumentParser()
ap.add_argument('--lens', default='320,1024')
ap.add_argument('--max-num-seqs', type=int, default=1)
args = ap.parse_args()
model = jspec.load_model()
for L in [int(x) for x in args.lens.split(',')]:
    for name, spec in (("off", SpecConfig()), ("ngram:4", SpecConfig("ngram", num_speculative_tokens=4))):
        e = LLMEngine(model, EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_seqs * 5 + 256, max_model_len=L, max_burst_steps=8), spec)
        e.warmup()
        best = None
        for rep in range(2):
            r = e.add_request(f"{rep}", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
            t = time.perf_counter()
            while e.has_unfinished_requests():
                e.step()
            tpot = r.metrics.time_per_output_token
            best = tpot if best is None else min(best, tpot)
            e.pop_finished()
        steps = r.metrics.num_steps
        print(f"max_num_seqs {args.max_num_seqs} max_model_len {L} {name}: TPOT {1e3*best:.1f} ms, steps {steps}, ms/step {1e3*best*64/steps:.1f}", flush=True)
        e.__dict__.clear(); jax.clear_caches(); gc.collect()
