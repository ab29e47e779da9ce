"""Hugging Face peers of the decode benchmark: transformers OPT/Llama with random bf16 weights.

  python -m dejavu_jax.eval.bench_hf --models opt-6.7b --contexts 128,1024 --batch 1,4,16 \
      --modes hf-eager,hf-compiled --out hf.json

`bench_decode --modes ...,hf-eager,hf-compiled` runs this in a child process before JAX
touches the accelerator (JAX preallocates most of the GPU memory) and merges its rows.

The model is `OPTForCausalLM` (or `LlamaForCausalLM`) built from an HF config whose sizes
come from our preset (`hf_config`), created on the device directly in `--dtype`, with
HF's own random init, in eval mode under `torch.inference_mode`. Per (context, batch):

hf-eager     prefill the prompt (use_cache, `logits_to_keep=1`) into a `DynamicCache`, then
             one forward call per new token with the cache; each token synchronised.
hf-compiled  a `StaticCache` of `cache_len` slots; prefill runs uncompiled (as `generate`
             does), decode steps run `torch.compile(model.forward, mode="reduce-overhead")`
             (CUDA graphs). Every step passes a fixed-length all-ones attention mask and
             explicit position ids, so one graph serves every step (no graph break from the
             cache length; the graph count is recorded). A failure is recorded in the
             output's "errors" and the row is skipped.

Rows: median and p90 ms/token (host-synchronised after every token, like bench_decode's
`ms`), prefill ms (median of `--prefill-reps` after a warm run), compile_s (hf-compiled:
the first compiled call), peak memory (`torch.cuda.max_memory_allocated` since the row
started: weights, cache and activations), and `check_max_abs_diff`: the logits of one more
cached step against an uncached forward over the whole sequence (a check that the timed
loop really decodes from its cache).

This module imports neither JAX nor, at import time, torch: `bench_decode` imports its
helpers, and it runs under an interpreter that has torch but not JAX when run by path
(`python eval/bench_hf.py ...`; the presets are then read from dejavu_jax/config.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

HF_MODES = ("hf-eager", "hf-compiled")


def cache_len(context: int, warmup: int, steps: int) -> int:
    """Cache slots of one benchmark row: the prompt, the synchronised warmup and timed steps,
    the two device-loop runs of bench_decode (one warm, one timed) and a margin of 64.
    The HF static cache gets the same length, so both attend over equally long buffers."""
    return context + warmup + 3 * steps + 64


def _config_module():
    """dejavu_jax.config, or the same file loaded by path where JAX is missing (that
    module imports only the standard library, but the package's __init__ imports JAX)."""
    try:
        from dejavu_jax import config
        return config
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "dejavu_jax" / "config.py"
        spec = importlib.util.spec_from_file_location("_dejavu_config", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses looks the module up while it builds
        spec.loader.exec_module(module)
        return module


def preset(name: str):
    """Our ModelConfig preset `name`."""
    return _config_module().preset(name)


def hf_config_dict(config) -> tuple[str, dict]:
    """(model_type, HF config kwargs) with our ModelConfig's sizes; the inverse of
    `dejavu_jax.config.from_hf_config` (tests check the round trip)."""
    c = config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden, num_hidden_layers=c.n_layers,
                  num_attention_heads=c.n_heads, max_position_embeddings=c.max_positions,
                  tie_word_embeddings=c.tie_embeddings, bos_token_id=c.bos_token_id,
                  eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, use_cache=True)
    if c.family == "opt":
        if c.n_kv_heads != c.n_heads or c.head_dim * c.n_heads != c.hidden:
            raise ValueError(f"{c.name}: OPT needs n_kv_heads == n_heads and head_dim * n_heads "
                             "== hidden")
        if c.attention_bias != c.mlp_bias:
            raise ValueError(f"{c.name}: OPT has one enable_bias for attention and MLP")
        kw = dict(common, ffn_dim=c.ffn, word_embed_proj_dim=c.embed_dim,
                  do_layer_norm_before=c.pre_norm, enable_bias=c.attention_bias,
                  activation_function=c.activation, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, layerdrop=0.0)
        if c.final_norm != c.pre_norm:
            kw["_remove_final_layer_norm"] = not c.final_norm
        return "opt", kw
    if c.embed_dim != c.hidden:
        raise ValueError(f"{c.name}: {c.family} has no embedding projections")
    kw = dict(common, intermediate_size=c.ffn, num_key_value_heads=c.n_kv_heads,
              head_dim=c.head_dim, rms_norm_eps=c.norm_eps)
    layer_types = ([("sliding_attention" if s else "full_attention") for s in c.sliding_layers]
                   if c.sliding_layers else None)
    full_rope = ({"rope_type": "linear", "factor": c.rope_linear_factor, "rope_theta": c.rope_theta}
                 if c.rope_linear_factor != 1.0 else
                 {"rope_type": "default", "rope_theta": c.rope_theta})
    if c.family == "gemma":
        kw.update(hidden_act={"gelu_tanh": "gelu_pytorch_tanh"}.get(c.activation, c.activation),
                  attention_bias=c.attention_bias, rope_parameters=full_rope)
        return "gemma", kw
    if c.family == "gemma3":   # Gemma 3, or Gemma 2 (no q/k norms, one RoPE)
        kw.update(hidden_activation="gelu_pytorch_tanh", attention_bias=c.attention_bias,
                  query_pre_attn_scalar=round(c.attention_scale ** -2),
                  sliding_window=c.sliding_window or 4096,
                  layer_types=layer_types or ["full_attention"] * c.n_layers,
                  final_logit_softcapping=c.final_logit_softcap,
                  attn_logit_softcapping=c.attn_logit_softcap)
        if not c.qk_norm:
            return "gemma2", dict(kw, rope_parameters=full_rope)
        local = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
        kw["rope_parameters"] = {"full_attention": full_rope,
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": local}}
        return "gemma3_text", kw
    kw.update(hidden_act=c.activation, rope_theta=c.rope_theta, rope_parameters=full_rope)
    if c.rope_longrope is not None or c.rotary_dim is not None:   # Phi-3's own RoPE
        return "phi3", _phi3_kwargs(c, kw, layer_types)
    if c.family == "qwen2":
        if layer_types:
            kw.update(use_sliding_window=True, sliding_window=c.sliding_window,
                      layer_types=layer_types)
        return "qwen2", kw
    if c.qk_norm:  # the Llama family's q/k norms are Qwen3's
        kw.update(attention_bias=c.attention_bias, head_dim=c.head_dim,
                  use_sliding_window=bool(layer_types), sliding_window=c.sliding_window,
                  layer_types=layer_types or ["full_attention"] * c.n_layers)
        return "qwen3", kw
    kw.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    return "llama", kw


def _phi3_kwargs(c, kw: dict, layer_types) -> dict:
    """Phi3Config keywords: its LongRoPE factors and partial rotary factor."""
    rope = dict(kw["rope_parameters"],
                partial_rotary_factor=c.rotated_dims / c.head_dim)
    kw = {k: v for k, v in kw.items() if k != "head_dim"}
    if c.rope_longrope is not None:
        attention, original, *factors = c.rope_longrope
        half = len(factors) // 2
        rope.update(rope_type="longrope", attention_factor=attention,
                    original_max_position_embeddings=int(original),
                    short_factor=factors[:half], long_factor=factors[half:])
        kw["original_max_position_embeddings"] = int(original)
    if layer_types:
        kw["sliding_window"] = c.sliding_window
    return dict(kw, rope_parameters=rope, partial_rotary_factor=rope["partial_rotary_factor"])


HF_CLASSES = {"opt": ("OPTConfig", "OPTForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma": ("GemmaConfig", "GemmaForCausalLM"),
              "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
              "phi3": ("Phi3Config", "Phi3ForCausalLM"),
              "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_config(config):
    """A transformers config (OPT, Llama, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2 or Gemma 3
    text) with our ModelConfig's sizes."""
    import transformers
    kind, kw = hf_config_dict(config)
    return getattr(transformers, HF_CLASSES[kind][0])(**kw)


def build_model(config, device: str, dtype: str, attn: str):
    """The HF causal LM of `config`, random weights (HF init, seed 0) made on `device`."""
    import torch
    import transformers
    hf = hf_config(config)
    hf._attn_implementation = attn
    cls = getattr(transformers, HF_CLASSES[hf.model_type][1])
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = cls._from_config(hf, dtype=getattr(torch, dtype))
        except TypeError:  # transformers before the `dtype` keyword
            model = cls._from_config(hf, torch_dtype=getattr(torch, dtype))
    return model.eval()


class Runner:
    """Version-adaptive forward calls: transformers 5.x renamed `past_key_values` to
    `cache` (5.24 accepts both until 5.40) and dropped `cache_position`."""

    def __init__(self, model):
        params = inspect.signature(model.forward).parameters
        self.model = model
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        self.logits_to_keep = "logits_to_keep" in params

    def kwargs(self, cache, start: int, length: int, device, batch: int | None = None,
               mask_len: int | None = None, explicit_positions: bool = False) -> dict:
        import torch
        kw = {self.cache_kw: cache, "use_cache": True}
        if self.logits_to_keep:
            kw["logits_to_keep"] = 1
        if self.cache_position:
            kw["cache_position"] = torch.arange(start, start + length, device=device)
        if explicit_positions:
            kw["position_ids"] = torch.arange(start, start + length,
                                              device=device).expand(batch, length)
        if mask_len is not None:
            kw["attention_mask"] = torch.ones((batch, mask_len), dtype=torch.long, device=device)
        return kw

    def out_cache(self, out):
        return getattr(out, "cache", None) if self.cache_kw == "cache" else out.past_key_values


def static_cache(model, batch: int, max_len: int, device, dtype):
    """A transformers StaticCache of `max_len` slots (5.x lazy form, or the older one that
    takes the batch, device and dtype up front)."""
    from transformers import StaticCache
    params = inspect.signature(StaticCache.__init__).parameters
    kw = dict(config=model.config, max_cache_len=max_len)
    if "max_batch_size" in params:
        kw.update(max_batch_size=batch, device=device, dtype=dtype)
    return StaticCache(**kw)


def _sync(device: str):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_p90(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return statistics.median(s), p90


def run_row(model, runner: Runner, mode: str, context: int, batch: int, warmup: int,
            steps: int, prefill_reps: int, device: str, compile_mode: str, check: bool,
            log) -> dict:
    """One row: mode at (context, batch). Raises on failure (the caller records it)."""
    import torch
    dev = torch.device(device)
    cuda = device.startswith("cuda")
    gen = torch.Generator(device="cpu").manual_seed(2)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (batch, context), generator=gen).to(dev)
    tok = torch.full((batch, 1), 42, dtype=torch.long, device=dev)
    S = cache_len(context, warmup, steps)
    row = dict(mode=mode, context=context, batch=batch, cache_len=S, warmup=warmup,
               steps=steps, attn=model.config._attn_implementation, compile_s=None,
               ms_loop=None)
    if cuda:
        gc.collect()  # the previous row's cache and graphs
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    static = static_cache(model, batch, S, dev, model.dtype) if mode == "hf-compiled" else None

    def prefill():
        """(cache ready for decoding at slot `context`, seconds)."""
        if static is None:
            kw = runner.kwargs(None, 0, context, dev)
        else:
            static.reset()
            kw = runner.kwargs(static, 0, context, dev, batch, mask_len=S,
                               explicit_positions=True)
        _sync(device)
        t = time.perf_counter()
        out = model(input_ids=prompt, **kw)
        _sync(device)
        elapsed = time.perf_counter() - t
        return (runner.out_cache(out) if static is None else static), elapsed

    with torch.inference_mode():
        prefill_times = [prefill()[1] for _ in range(1 + prefill_reps)][1:]
        row["prefill_ms"] = statistics.median(prefill_times) * 1e3
        cache, _ = prefill()
        forward = model.forward
        if mode == "hf-compiled":
            import torch._dynamo
            from torch._dynamo.utils import counters
            torch._dynamo.reset()  # a fresh compile per row (and no cache-size-limit fallback
            counters.clear()       # to eager after many shapes); compile_s is this row's
            forward = torch.compile(model.forward, mode=compile_mode)

        held = {"cache": cache}

        def step(pos):
            if mode == "hf-eager":
                kw = runner.kwargs(held["cache"], pos, 1, dev)
            else:
                kw = runner.kwargs(held["cache"], pos, 1, dev, batch, mask_len=S,
                                   explicit_positions=True)
            out = forward(input_ids=tok, **kw)
            if mode == "hf-eager":
                held["cache"] = runner.out_cache(out)
            return out

        times = []
        pos = context
        for i in range(warmup + steps):
            _sync(device)
            t = time.perf_counter()
            step(pos)
            _sync(device)
            dt = time.perf_counter() - t
            pos += 1
            if i == 0 and mode == "hf-compiled":
                row["compile_s"] = dt
            if i >= warmup:
                times.append(dt)
        med, p90 = _median_p90(times)
        row.update(ms=med * 1e3, p90_ms=p90 * 1e3)
        seen = held["cache"].get_seq_length()
        row["cache_tokens_after"] = int(seen)
        if int(seen) != context + warmup + steps:
            raise RuntimeError(f"cache holds {int(seen)} tokens after the loop, expected "
                               f"{context + warmup + steps}")
        if mode == "hf-compiled":
            row["dynamo"] = dict(unique_graphs=counters["stats"].get("unique_graphs", 0),
                                 graph_breaks=sum(counters["graph_break"].values()),
                                 recompiles=sum(counters.get("recompiles", {}).values()))
        if cuda:
            row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        else:
            row["peak_bytes"] = None
        if check:
            cached = step(pos).logits[:, -1].float().clone()
            seq = torch.cat([prompt, tok.expand(batch, pos + 1 - context)], 1)
            kw = {"logits_to_keep": 1} if runner.logits_to_keep else {}
            full = model(input_ids=seq, use_cache=False, **kw).logits[:, -1].float()
            row["check_max_abs_diff"] = float((cached - full).abs().max())
            row["check_logit_scale"] = float(full.abs().max())
    log(json.dumps(row))
    return row


def run(models, contexts, batches, modes, warmup, steps, prefill_reps, device, dtype, attn,
        compile_mode, check, log) -> dict:
    """All HF rows; {"meta", "rows", "errors"} (meta["skipped"] says why there are none)."""
    meta = dict(python=platform.python_version(), device_requested=device, dtype=dtype,
                attn=attn, compile_mode=compile_mode, skipped=None)
    try:
        import torch
        import transformers
    except Exception as e:  # torch (or transformers) not importable here
        meta["skipped"] = (f"torch/transformers not importable in {sys.executable}: "
                           f"{type(e).__name__}: {e}")
        return dict(meta=meta, rows=[], errors=[])
    meta.update(torch=torch.__version__, transformers=transformers.__version__)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            meta["skipped"] = f"torch {torch.__version__} sees no CUDA device"
            return dict(meta=meta, rows=[], errors=[])
        meta["device"] = torch.cuda.get_device_name(torch.device(device))
    else:
        meta["device"] = device
    rows, errors = [], []
    for name in models:
        config = preset(name)
        try:
            t = time.perf_counter()
            model = build_model(config, device, dtype, attn)
            _sync(device)
            n = sum(p.numel() * p.element_size() for p in model.parameters())
            log(f"{name}: HF {type(model).__name__}, {n / 1e9:.2f} GB weights on {device}, "
                f"build {time.perf_counter() - t:.1f}s")
        except Exception as e:
            errors.append(dict(model=name, error=f"{type(e).__name__}: {str(e)[:600]}"))
            log(f"FAILED building HF {name}: {errors[-1]['error']}")
            continue
        runner = Runner(model)
        for mode in modes:
            for ctx in contexts:
                for batch in batches:
                    try:
                        row = run_row(model, runner, mode, ctx, batch, warmup, steps,
                                      prefill_reps, device, compile_mode, check, log)
                    except Exception as e:  # record, skip the row, go on
                        err = dict(model=name, mode=mode, context=ctx, batch=batch,
                                   error=f"{type(e).__name__}: {str(e)[:600]}",
                                   traceback=traceback.format_exc()[-2000:])
                        errors.append(err)
                        log(f"FAILED {name} {mode} ctx={ctx} batch={batch}: {err['error']}")
                        if device.startswith("cuda"):
                            torch.cuda.empty_cache()
                        continue
                    rows.append(dict(model=name, layout="hf", mlp=1.0, heads=1.0, indices="-",
                                     **row))
        del model, runner
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return dict(meta=meta, rows=rows, errors=errors)


def parse_list(text: str, kind=str) -> list:
    """'a,b,c' -> [kind(a), kind(b), kind(c)] (empty entries dropped)."""
    return [kind(v) for v in text.split(",") if v.strip()]


def main(argv=None) -> int:
    """Run the HF rows; writes {"meta", "rows", "errors"} as JSON to --out."""
    p = argparse.ArgumentParser(prog="python -m dejavu_jax.eval.bench_hf")
    p.add_argument("--models", default="opt-6.7b")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--modes", default="hf-eager,hf-compiled")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--device", default="cuda", help="torch device (cpu for a local check)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attn", default="sdpa", help="HF attn_implementation")
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help="torch.compile mode of hf-compiled")
    p.add_argument("--no-check", action="store_true",
                   help="skip the cached-vs-uncached logits check after each row")
    p.add_argument("--out", required=True, help="JSON file")
    args = p.parse_args(argv)
    modes = parse_list(args.modes)
    unknown = [m for m in modes if m not in HF_MODES]
    if unknown:
        p.error(f"unknown HF modes {unknown}; known: {', '.join(HF_MODES)}")

    def log(msg):
        print(msg, flush=True)

    result = run(parse_list(args.models), parse_list(args.contexts, int),
                 parse_list(args.batch, int), modes, args.warmup, args.steps,
                 args.prefill_reps, args.device, args.dtype, args.attn, args.compile_mode,
                 not args.no_check, log)
    if result["meta"]["skipped"]:
        log(f"HF rows skipped: {result['meta']['skipped']}")
    result["meta"]["command"] = " ".join([sys.executable] + sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run by path: keep eval/'s modules from shadowing others
    raise SystemExit(main())
