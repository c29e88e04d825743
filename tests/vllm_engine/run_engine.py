"""Run vLLM's engine on the demo model in this process and print its greedy tokens and logprobs as JSON:
the vLLM tests start it in a subprocess per configuration (LONGPATCH_CONFIG is read per process).

    python tests/vllm_engine/run_engine.py PROMPT_LENGTHS NEW_TOKENS [--chunk N] [--prefix-caching]
        [--prompt-logprobs] [--calls] [--blocks N]

--calls runs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and adds each replaced
layer's calls by phase and path (its route's counters) to the result.
"""
import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lengths")
    ap.add_argument("new_tokens", type=int)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--prompt-logprobs", action="store_true", help="also the prompt tokens' logprobs")
    ap.add_argument("--calls", action="store_true", help="also the routes' calls (engine core in this process)")
    ap.add_argument("--blocks", type=int, default=None, help="KV cache blocks (few: requests get preempted)")
    a = ap.parse_args()
    if a.calls:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    import longpatch
    lengths = [int(x) for x in a.lengths.split(",")]
    g = torch.Generator().manual_seed(0)
    vocab = 500  # well inside the demo tokenizer's vocabulary
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]
    if len(prompts) > 1:  # the second prompt shares the first's opening: with prefix caching a hit of 512 tokens
        share = 528  # (vLLM caches whole blocks of 32), on the grid of the demo configs' blocks of 256
        prompts[1][:share] = prompts[0][:share]
    llm = LLM(model=str(longpatch.demo_model_path()), dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=max(lengths) + a.new_tokens + 32, max_num_batched_tokens=a.chunk,
              enable_prefix_caching=a.prefix_caching, seed=0, num_gpu_blocks_override=a.blocks,
              disable_log_stats=False)
    sp = SamplingParams(temperature=0, max_tokens=a.new_tokens, logprobs=0, ignore_eos=True,
                        prompt_logprobs=0 if a.prompt_logprobs else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        row = {"prompt": prompts[len(rows)], "tokens": list(c.token_ids),
               "logprobs": [next(iter(d.values())).logprob for d in c.logprobs],
               "preemptions": o.metrics.num_preemptions}
        if a.prompt_logprobs:  # the first prompt token has none
            row["prompt_logprobs"] = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], row["prompt"][1:])]
        rows.append(row)
    if a.calls:
        from longpatch.serving.plugin import routes_for
        routes = routes_for(llm.llm_engine.model_config.hf_text_config.num_hidden_layers)
        for row in rows:
            row["calls"] = {str(r.layer_idx): {"/".join(key): n for key, n in r.calls.items()} for r in routes
                            if r.method is not None}
    print("RESULT " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
