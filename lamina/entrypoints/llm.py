"""`LLM`: the public, vLLM-style entry point.

Data in: a model path (None = the embedded SmolLM2), prompts or chat messages, and
`SamplingParams`. Data out: `RequestOutput`s in prompt order. `executor="local"` runs
the compute and memory sides in this process; `executor="ray"` (lamina.cluster) puts
them in Ray workers, and keeps their count (`keeper`: memory workers a recovery
dropped come back when the cluster holds them again).
"""
from __future__ import annotations

import inspect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Sequence, cast

from lamina.engine.beam_search import BeamSearchParams, beam_search
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.engine.inputs import TokensPrompt, check_unicode
from lamina.engine.outputs import MemoryScale, RequestOutput
from lamina.entrypoints.autoscale import KeepSize, check_seconds, scale_beside
from lamina.entrypoints.calls import Call, CallRequest, SharedEngine
from lamina.entrypoints.interrupts import StepBoundary
from lamina.entrypoints.logs import configure_logging
from lamina.executor.base import plugin_executor
from lamina.sampling.params import SamplingParams

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lamina.entrypoints.deploy_config import LaminaConfig
    from lamina.model.loader import LoadedModel, ModelInfo


def batch_of(prompts, params) -> tuple[list, list[SamplingParams]]:
    """`generate`'s arguments as (prompts, one SamplingParams each): one prompt (text,
    token ids or a `TokensPrompt`) or a list; one SamplingParams for all, one per prompt,
    or None."""
    if isinstance(prompts, (str, TokensPrompt)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    params = params or SamplingParams()
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    return list(prompts), plist


def per_prompt(value, n: int, what: str) -> list:
    """One value for all n prompts, or a list/tuple of one per prompt."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{n} prompts but {len(values)} {what}")
    return values


class LLM:
    def __init__(self, model: str | None = None, executor: str = "local",
                 num_memory_workers: int = 1, dtype: str = "float32",
                 address: str | None = None, regrow_interval_s: float = 10.0,
                 **engine_kw):
        from lamina.executor.local import LocalExecutor
        from lamina.memory.memory_side import MemorySide
        from lamina.memory.pool import KVPool, KVPoolConfig
        from lamina.model.loader import load
        from lamina.model.prepare import (
            key_channel_scales,
            prepare_split,
            rotary_frequencies,
            sparsity_for,
        )
        from lamina.splitter.dense import DenseChoice

        configure_logging()  # a first start's kernel build and trace say so as they run
        if executor not in ("local", "ray"):
            raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
        if address is not None and executor == "local":
            raise ValueError("address names a Ray cluster: it needs executor='ray'")
        check_seconds("regrow_interval_s", regrow_interval_s, " (0: never)")
        self.config = EngineConfig(num_memory_workers=num_memory_workers, **engine_kw)
        if executor != "local":
            plugin_executor(executor).check(self.config)
        # the weights: in this process for the local executor, else only in the workers
        self.loaded: LoadedModel | ModelInfo
        if executor != "local":
            self.split = None
            self.loaded, self.executor = self._start_workers(model, dtype, executor, address)
            # the compute worker's DenseChoice
            self.dense = getattr(self.executor, "dense", None) or DenseChoice(
                "unknown", f"the {executor!r} executor does not report it")
        else:
            cfg, lm = self.config, load(model, dtype=dtype)
            self.loaded = lm
            prep = prepare_split(lm.model, cfg.dense_backend, cfg.max_batch,
                                 cfg.fuse_pointwise, cfg.compute_device)
            self.split, self.dense = prep.split, prep.dense
            rope = rotary_frequencies(lm.model) if cfg.tiers.enabled else None
            specs = self.split.attention_specs
            scales = (key_channel_scales(lm.model, lm.tokenizer, len(specs))
                      if cfg.kv_dtype == "int8" else None)
            pool_cfg = KVPoolConfig.for_specs(specs, cfg.num_kv_slots, cfg.kv_dtype,
                                              cfg.kv_device, scales, cfg.kv_pool_bytes,
                                              cfg.kv_huge_pages, cfg.kv_prefault)
            sparsity = sparsity_for(cfg.sparsity, lm.model, lm.tokenizer, len(specs))
            self.executor = LocalExecutor(
                self.split, [MemorySide(KVPool(pool_cfg), tiers=cfg.tiers, worker=w,
                                        rope_inv_freq=rope, sparsity=sparsity)
                             for w in range(num_memory_workers)],
                vocab_size=int(lm.config.vocab_size), faults=self.config.faults,
                device=cfg.compute_device, graph_tokens=cfg.graph_tokens,
                num_compute_workers=cfg.num_compute_workers, pipeline=cfg.pipeline)
        try:
            self._start_engine()
            # memory workers a recovery dropped (their node lost) come back once the
            # cluster holds them (`KeepSize`; a local executor never drops one)
            self.engine.keeper = None if executor == "local" else KeepSize(
                lambda: self.engine, lambda: self.config.num_memory_workers,
                lambda fn: self._shared.call(fn), self._scaling,
                regrow_interval_s, f"the LLM ({executor} executor)")
        except BaseException:
            self.executor.shutdown()  # a Ray deployment's workers and placement with it
            raise

    def _start_workers(self, model, dtype, executor: str, address: str | None) -> tuple:
        """(this process's `ModelInfo`, the started executor). The workers start while
        this process reads the tokenizer and config (~4 s on a Zen 1 core, mostly
        transformers' imports). A GGUF not yet converted at `dtype` is converted here
        first, once, for the workers on this node to load (`load_info`); a path that
        holds no model fails before any worker starts."""
        from lamina.model.loader import converted, load_info

        start = plugin_executor(executor)
        if not converted(model, dtype):
            return load_info(model, dtype=dtype), start(model, dtype, self.config,
                                                        address=address)
        with ThreadPoolExecutor(1, thread_name_prefix="lamina-model-info") as pool:
            info = pool.submit(load_info, model, dtype=dtype)
            ex = start(model, dtype, self.config, address=address)  # its error wins
            try:
                return info.result(), ex
            except BaseException:
                ex.shutdown()
                raise

    def _start_engine(self) -> None:
        # the pools' slot count (kv_pool_bytes: as many as fit) is what the engine allocates
        slots = getattr(self.executor, "pool_slots", self.config.num_kv_slots)
        if slots != self.config.num_kv_slots:
            self.config = replace(self.config, num_kv_slots=slots)
        if self.config.split_kv and any(p.sinks is not None for p in self.executor.params):
            # sinks enter one partial's denominator only; KV split is not offered for them
            self.config = replace(self.config, split_kv=False)
        self.engine = LLMEngine(self.config, self.executor, self.loaded.tokenizer,
                                self.loaded.config)
        self._shared_engine = SharedEngine(self.engine)  # generate's calls, any thread
        self._scaling = threading.Lock()  # one `scale_memory_workers` at a time

    @property
    def keeper(self) -> KeepSize | None:
        """What grows the engine back to its memory workers' count (`KeepSize`:
        `missing()`, `why`, `failed`); None for the local executor, which never drops one."""
        return self.engine.keeper

    @property
    def _shared(self) -> SharedEngine:
        """`generate`'s way into the engine (made again if `engine` was replaced)."""
        shared = self.__dict__.get("_shared_engine")
        if shared is None or shared.engine is not self.engine:
            shared = self._shared_engine = SharedEngine(self.engine)
        return shared

    @classmethod
    def from_config(cls, config: LaminaConfig) -> LLM:
        """An `LLM` as a `LaminaConfig` (e.g. `LaminaConfig.from_yaml(path)`) describes."""
        e = config.engine
        kw = {f.name: getattr(e, f.name) for f in fields(e) if f.name != "num_memory_workers"}
        c = config.cluster
        return cls(config.model.path, executor=c.executor,
                   num_memory_workers=e.num_memory_workers, dtype=config.model.dtype,
                   address=c.address, regrow_interval_s=c.regrow_interval_s, **kw)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 session_id: str | Sequence[str | None] | None = None,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """`session_id`: the conversation each prompt continues (one id, or one per
        prompt); with KV tiers (`kv_host_bytes`) its KV outlives the pool for the next
        turn. `priority` (one, or one per prompt): with scheduling_policy "priority",
        lower is served first. Ctrl-C stops the call once the step in flight ends
        (KeyboardInterrupt; a second one stops the step too): its requests are aborted
        and the engine is left as before the call. Calls from several threads share the
        engine: their requests batch together and each call returns with its own."""
        self._shared.check_open()
        prompts, plist = batch_of(prompts, params)
        sids = per_prompt(session_id, len(prompts), "session ids")
        prios = per_prompt(priority, len(prompts), "priorities")
        for i, (p, sp, sid, pr) in enumerate(zip(prompts, plist, sids, prios)):
            try:  # all before any runs
                self.engine.validate(p, sp, sid, pr)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        call = Call(len(prompts), bar.update if bar is not None else None)
        try:
            self._shared.add(call, [CallRequest(*r) for r in zip(prompts, plist, sids, prios)])
            with StepBoundary() as stop:
                self._shared.run(call, stop)
            if stop.asked:  # (after the last step too: the Ctrl-C is not lost)
                raise KeyboardInterrupt("generate stopped after the step in flight; its "
                                        "requests were aborted")
        except BaseException:  # Ctrl-C or a step's error: the call's requests go
            self._shared.abort(call)
            raise
        finally:
            if bar:
                bar.close()
        return cast(list[RequestOutput], call.results)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.beam_search`, with HF's algorithm (`lamina.engine.beam_search`):
        one `RequestOutput` a prompt, its outputs the `beam_width` best beams, best first
        (each with `score`, `token_ids`, `text`, per-token `logprobs`). Every prompt is
        checked before any runs; a prompt whose search fails comes back with `error`
        set, the others go on. `concurrency_limit`: prompts searched at once (None:
        all); `use_tqdm`: a bar of the rounds run."""
        tok, prompts = self.loaded.tokenizer, batch_of(prompts, None)[0]
        if not self.config.prefix_caching:
            log.warning("beam search with prefix_caching off: every round recomputes each "
                        "beam's whole context (on, a round computes one token a beam)")
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(desc="beam search rounds", unit="round")
        try:
            return beam_search(
                prompts, params, self.engine.eos_ids, self.engine.validate,
                lambda ids, plist: self.generate(ids, plist, use_tqdm=False),
                lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
                concurrency_limit, bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()

    def chat(self, messages, params: SamplingParams | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, **kw) -> list[RequestOutput]:
        """messages: one conversation (list of {role, content}) or a list of them; a
        content may be OpenAI's list of text parts; the template's options as
        `chat_prompt`'s (vLLM's names)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.loaded.tokenizer
        prompts = [chat_tokens(tok, chat_prompt(
            tok, c, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=chat_template_kwargs)) for c in convs]
        return self.generate(prompts, params, **kw)

    def scale_memory_workers(self, n: int) -> MemoryScale:
        """Grow or shrink the KV pool to `n` memory workers while `generate` calls run in
        other threads (`LLMEngine.scale_memory_workers`: the sequences that had KV on a
        leaving worker move it into kept pools, or are preempted where those lack room).
        New workers are started on this thread, beside the steps; only their wiring
        waits for a step to end."""
        with self._scaling:  # (only a scale changes the count: one at a time)
            done = scale_beside(self.engine, n, self._shared.call)
            self.config = replace(self.config, num_memory_workers=n)
            return done

    def shutdown(self) -> None:
        """Stop the workers (a Ray deployment's, with its placement group); later calls
        raise `EngineDead`, and so does one still running in another thread, at its
        next step. A second call does nothing."""
        why = "this LLM was shut down (LLM.shutdown()): its workers are gone; make a new LLM"
        if self.keeper is not None:
            self.keeper.stop()
        self._shared.close(why)
        self.engine.shutdown(why)


def chat_prompt(tokenizer, messages: list[dict], tools: list | None = None,
                parser=None, add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
    """A conversation as the model's chat template writes it, ready for the answer.
    OpenAI's `developer` role (what clients send newer models instead of `system`) is
    `system` to a template that does not name it: most templates know only system /
    user / assistant / tool, and would otherwise raise or show it as an unknown turn
    (SmolLM2's puts its default system prompt before it). A template that refuses the
    conversation (its `raise_exception`) -> ValueError naming `messages`. `tools`:
    OpenAI's tool definitions, for a template that shows them to the model; `parser`
    (a `tool_parsers.ToolParser`, tool_choice "auto"): for a template that does not
    show them, its format's system prompt lists them, before the conversation's own.
    Earlier tool calls are written as text for a template that has no place for them.
    `add_generation_prompt`: open the assistant's turn (False: the conversation as is).
    `continue_final_message`: leave the last message (the assistant's start of an
    answer) open, for the model to go on with it. `template_kwargs`: more variables for
    the template (vLLM's `chat_template_kwargs`, e.g. a model's `enable_thinking`)."""
    from jinja2 import TemplateError

    from lamina.entrypoints.api_tools import history_for_template

    template = str(getattr(tokenizer, "chat_template", None) or "")
    msgs = [template_message(m, i) for i, m in enumerate(messages)]
    if "developer" not in template:
        msgs = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in msgs]
    msgs = history_for_template(msgs, template, parser)
    if parser is not None and tools and "tools" not in template:
        listed = parser.system_prompt(tools)
        if msgs[0].get("role") == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{listed}"}
        else:
            msgs.insert(0, {"role": "system", "content": listed})
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message: the last message cannot be continued "
                         "with a new turn opened after it (add_generation_prompt: false)")
    extra = _template_kwargs(tokenizer, template_kwargs)
    try:
        return tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **extra)
    except TemplateError as e:
        raise ValueError(f"messages: the model's chat template refused them: {e}") from None
    except ValueError as e:  # HF's refusal of a final message it cannot continue
        raise ValueError(f"messages: {e}") from None


def chat_tokens(tokenizer, text: str) -> TokensPrompt:
    """A chat prompt written by `chat_prompt` -> its token ids with no special tokens
    added (the template wrote those it wants), as HF's apply_chat_template(tokenize=True)
    and vLLM tokenize a chat; the text rides along for `RequestOutput.prompt`."""
    check_unicode(text, "the chat prompt its messages make")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return TokensPrompt(tuple(ids), text)


def _template_kwargs(tokenizer, kwargs: dict | None) -> dict:
    """vLLM's chat_template_kwargs: variables for the template; the names of
    `apply_chat_template`'s own arguments (tokenize, chat_template, ...) are refused,
    so a request cannot change how the prompt is made beyond the template's text."""
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs: must be an object of template variables")
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    taken = sorted(own & set(kwargs))
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken} are not template variables (the "
                         f"request's own fields set what they may)")
    return kwargs


def template_message(msg: dict, i: int = 0) -> dict:
    """Message `i` of a chat as chat templates read it: its content a string, OpenAI's
    text parts joined by newlines (as vLLM joins them), null only for an assistant's
    (tool-call) turn; ValueError naming what it cannot read."""
    role, content = msg.get("role"), msg.get("content")
    if content is None:
        if role != "assistant":
            raise ValueError(f"messages.{i}.content: null is allowed only for the "
                             f"assistant, not {role!r}")
        content = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages.{i}.content.{j}: a {kind!r} part; text parts "
                                 "({'type': 'text', 'text': ...}) only")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"messages.{i}.content: a string or a list of text parts, got "
                         f"{type(content).__name__}")
    check_unicode(content, f"messages.{i}.content")
    return {**{k: v for k, v in msg.items() if v is not None}, "content": content}
