"""The Qwen3-Omni talker as a stage of its own: from the thinker's prompt and reply token ids
to frames of 16 codec codes, one frame per decode step, equal to what transformers'
``Qwen3OmniMoeForConditionalGeneration.generate()`` produces on the same checkpoint.

For a text prompt the talker needs no thinker hidden state: generate() feeds it the thinker's
token *embeddings* (a row lookup in the thinker's embedding table) through the talker's
``text_projection``, so the stage boundary carries token ids only and this stage loads the
embedding table and the talker (not the thinker's layers). Audio or image input would need the
thinker's hidden states at the boundary (``hidden_projection``); that is not supported here.

:func:`talker_frames` is a generator: each ``next()`` runs one decode step (a talker forward
and the code predictor's 15 residual steps) and yields that step's frame, so the caller
decides between any two steps whether to go on: closing the generator is the cancellation
point. The decode loop is written out (a KV cache, the logits processors generate() uses)
rather than calling ``talker.generate()``, which cannot yield a frame before it finishes.

Everything here is blocking (torch); call it from a worker thread in async code.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...errors import ConfigError
from .checkpoint import checkpoint_tensors, load_part, read_config
from .sampling import TalkerSampling, logits_processors, pick, talker_sampling

__all__ = [
    "DecodeState",
    "Qwen3Talker",
    "Talker",
    "TalkerInputs",
    "TalkerSampling",
    "decode_step",
    "load_talker",
    "talker_frames",
    "talker_sampling",
]


@dataclass(frozen=True, slots=True)
class TalkerInputs:
    """What generate() builds between the thinker and the talker for one request."""

    #: [1, L, D] the talker's prompt
    prompt_embeds: Any
    #: [1, R, D] one row added to the input of each decode step while they last
    trailing_text: Any
    #: [1, 1, D] added to each step's input after the trailing rows ran out
    tts_pad: Any


class Talker(Protocol):
    """What the ``talker`` backend runs: a family's talker (:class:`Qwen3Talker`,
    :class:`~omni_trio.models.qwen_omni.qwen25_talker.Qwen25Talker`). ``prepare`` builds a
    request's input (``None``: nothing to say), ``frames`` decodes it one frame per step;
    ``start`` makes a request's decode state and ``step`` advances several of them by one
    step (what the backend's batched stepping calls)."""

    codes_per_frame: int
    family: str
    speakers: tuple[str, ...]
    device: str

    def prepare(
        self, prompt_ids: Sequence[int], reply_ids: Sequence[int], speaker: str
    ) -> object | None: ...

    def frames(self, inputs: Any, sampling: TalkerSampling) -> Generator[list[int], None, str]: ...

    def start(self, inputs: Any, sampling: TalkerSampling) -> Any: ...

    def step(self, states: Sequence[Any]) -> list[list[int] | str]: ...

    def num_parameters(self) -> int: ...


class Qwen3Talker:
    """The talker's weights and the thinker's embedding table, loaded from a checkpoint.
    Immutable once loaded; safe to use from one thread at a time per request (each request's
    state lives in its own generator)."""

    codes_per_frame = 16
    family = "qwen3-omni"

    def __init__(self, config: Any, embed: Any, talker: Any, device: str = "cpu") -> None:
        self.config = config
        self.embed = embed
        self.talker = talker
        #: where the weights live and every step runs ("cpu", "cuda", "cuda:1", ...)
        self.device = device
        self.speakers: tuple[str, ...] = tuple(sorted(config.talker_config.speaker_id))

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu") -> Qwen3Talker:
        """Blocking: reads the talker's tensors and the thinker's embedding table only, and
        moves them to ``device``."""
        import torch
        from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

        config = read_config(path)
        torch_dtype = getattr(torch, dtype)
        talker = load_part(
            Qwen3OmniMoeTalkerForConditionalGeneration,
            config.talker_config,
            path,
            "talker.",
            torch_dtype,
        )
        embed = checkpoint_tensors(path, "thinker.model.embed_tokens.weight")[""].to(torch_dtype)
        return cls(config, embed.to(device), talker.to(device), device)

    def frames(
        self, inputs: TalkerInputs, sampling: TalkerSampling
    ) -> Generator[list[int], None, str]:
        """:func:`talker_frames` of this talker: the decode of one request, step by step."""
        return talker_frames(self, inputs, sampling)

    def start(self, inputs: TalkerInputs, sampling: TalkerSampling) -> DecodeState:
        """A request's decode state, for :meth:`step` (batched decoding)."""
        return DecodeState(self, inputs, sampling)

    def step(self, states: Sequence[DecodeState]) -> list[list[int] | str]:
        """:func:`decode_step` of this talker."""
        return decode_step(self, states)

    def num_parameters(self) -> int:
        return int(sum(p.numel() for p in self.talker.parameters()) + self.embed.numel())

    def prepare(
        self, prompt_ids: Sequence[int], reply_ids: Sequence[int], speaker: str
    ) -> TalkerInputs | None:
        """generate()'s talker input for a text prompt, op for op (the same projections over
        the same slices, so the result is bit-identical, not only close). ``None`` when the
        reply has fewer than 2 tokens: there is nothing to say (generate() fails there).

        Raises ValueError for a prompt without an ``<|im_start|>assistant`` turn, a token id
        outside the thinker's vocabulary, or an unknown speaker."""
        import torch

        cfg, tc = self.config, self.config.talker_config
        if speaker.lower() not in tc.speaker_id:
            raise ValueError(f"unknown speaker {speaker!r}; speakers are {list(self.speakers)}")
        if len(reply_ids) < 2:
            return None
        vocab = self.embed.shape[0]
        bad = next((t for t in (*prompt_ids, *reply_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the thinker's vocabulary [0, {vocab})")
        n = len(prompt_ids)
        starts = [
            i
            for i in range(n - 1)
            if prompt_ids[i] == cfg.im_start_token_id
            and prompt_ids[i + 1] == cfg.assistant_token_id
        ]
        if not starts:
            raise ValueError("the prompt has no '<|im_start|>assistant' turn for the talker")
        # generate() reads the thinker's states of every token *fed* to it: the prompt and
        # the reply but its last token (never fed back)
        fed = [*prompt_ids, *reply_ids[:-1]]
        dev = self.device
        thinker_embed = self.embed[torch.tensor(fed, device=dev)].unsqueeze(0)
        user_rows = _user_rows(prompt_ids, cfg.im_start_token_id, cfg.user_token_id)
        project = self.talker.text_projection
        a = starts[-1]
        with torch.no_grad():
            user = project(thinker_embed[:, :n])[:, user_rows]
            specials = torch.tensor(
                [[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=dev
            )
            tts_bos, tts_eos, tts_pad = project(self.embed[specials]).chunk(3, dim=1)
            assistant = project(thinker_embed[:, a:])
            text_part = torch.cat(
                (assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:4]), dim=1
            )
            codec_ids = torch.tensor(
                [
                    [
                        tc.codec_nothink_id,
                        tc.codec_think_bos_id,
                        tc.codec_think_eos_id,
                        tc.speaker_id[speaker.lower()],
                        tc.codec_pad_id,
                        tc.codec_bos_id,
                    ]
                ],
                device=dev,
            )
            zeros = torch.zeros(
                1, 3, tc.text_config.hidden_size, dtype=self.talker.dtype, device=dev
            )
            codec_part = torch.cat((zeros, self.talker.get_input_embeddings()(codec_ids)), dim=1)
            trailing = torch.cat((assistant[:, 4:], tts_eos), dim=1)
            prompt = torch.cat((user, text_part + codec_part), dim=1)
        return TalkerInputs(prompt, trailing, tts_pad)


def _user_rows(prompt_ids: Sequence[int], im_start: int, user: int) -> list[int]:
    """Positions of every token of the prompt's user turns (role token after im_start)."""
    rows: list[int] = []
    role = None
    for i, t in enumerate(prompt_ids):
        if t == im_start:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        if role == user:
            rows.append(i)
    return rows


class DecodeState:
    """One request's decode between two steps: its KV cache, the next input row, the codes so
    far, its sampling (processors, generator). Owned by the request; changed only by
    :func:`decode_step`, which one thread runs at a time."""

    __slots__ = (
        "cache",
        "finished",
        "gen",
        "generated",
        "inputs",
        "predictor_procs",
        "sampling",
        "step",
        "talker_procs",
        "x",
    )

    def __init__(self, model: Qwen3Talker, inputs: TalkerInputs, sampling: TalkerSampling):
        import torch
        from transformers import DynamicCache

        tc = model.config.talker_config
        vocab = tc.text_config.vocab_size
        eos = tc.codec_eos_token_id
        dev = model.device
        self.inputs = inputs
        self.sampling = sampling
        self.gen = None
        if sampling.seed is not None:
            self.gen = torch.Generator(device=dev).manual_seed(sampling.seed)
        suppress = [i for i in range(vocab - 1024, vocab) if i != eos]
        self.talker_procs = logits_processors(sampling, suppress, dev)
        self.predictor_procs = logits_processors(sampling, None, dev)
        self.cache = DynamicCache(config=tc.text_config)
        self.x = inputs.prompt_embeds
        self.generated = torch.zeros(1, 0, dtype=torch.long, device=dev)
        self.step = 0
        #: the finish reason once the decode ended ("stop": the codec EOS, or "length")
        self.finished: str | None = None

    def __repr__(self) -> str:
        return f"<DecodeState step={self.step} finished={self.finished!r}>"


def _code0(model: Qwen3Talker, state: DecodeState) -> tuple[Any, Any] | None:
    """The talker's forward for one request: its code 0 and last hidden state, or None when
    the decode ends here (``state.finished`` says why)."""
    import torch

    dev = model.device
    x = state.x
    past = state.cache.get_seq_length()
    out = model.talker(
        inputs_embeds=x,
        past_key_values=state.cache,
        use_cache=True,
        position_ids=torch.arange(past, past + x.shape[1], device=dev).unsqueeze(0),
        attention_mask=torch.ones(1, past + x.shape[1], dtype=torch.long, device=dev),
        output_hidden_states=True,
        generation_step=state.step - 1,
    )
    logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
    code0 = pick(state.talker_procs(state.generated, logits), state.sampling.do_sample, state.gen)
    state.generated = torch.cat((state.generated, code0[:, None]), dim=1)
    if code0.item() == model.config.talker_config.codec_eos_token_id:
        state.finished = "stop"
    elif state.step == state.sampling.max_new_tokens - 1:
        state.finished = "length"
    if state.finished is not None:
        return None
    return code0, out.hidden_states[0][-1][:, -1:]


def _residual_codes(
    model: Qwen3Talker, states: Sequence[DecodeState], code0s: list[Any], hidden: list[Any]
) -> tuple[Any, Any]:
    """The code predictor, batched over requests (every row has the same length at each of
    its steps, so no padding): the 15 residual codes of each request's frame from its last
    hidden state and code 0's embedding. Returns (codes [B, 15], embeddings [B, 16, D])."""
    import torch
    from transformers import DynamicCache

    talker = model.talker
    cp = talker.code_predictor
    cache = DynamicCache(config=cp.config)
    code0 = torch.cat(code0s)[:, None]
    code0_embed = talker.get_input_embeddings()(code0)
    x = torch.cat((torch.cat(hidden), code0_embed), dim=1)
    embeds = [code0_embed]
    seq = torch.zeros(len(states), 0, dtype=torch.long, device=x.device)
    for j in range(talker.config.num_code_groups - 1):
        past = cache.get_seq_length()
        pos = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
        h = cp.model(
            inputs_embeds=x, past_key_values=cache, use_cache=True, position_ids=pos
        ).last_hidden_state
        logits = cp.lm_head[j](h)[:, -1, :].float()
        code = torch.cat(
            [
                pick(
                    st.predictor_procs(seq[r : r + 1], logits[r : r + 1]),
                    st.sampling.do_sample,
                    st.gen,
                )
                for r, st in enumerate(states)
            ]
        )
        seq = torch.cat((seq, code[:, None]), dim=1)
        x = cp.get_input_embeddings()[j](code[:, None])
        embeds.append(x)
    return seq, torch.cat(embeds, dim=1)


def decode_step(model: Qwen3Talker, states: Sequence[DecodeState]) -> list[list[int] | str]:
    """One decode step of every request in ``states``: the talker's forward per request (their
    caches differ in length), then the code predictor for all of them at once. Returns, per
    request, its frame (16 ints), or its finish reason when its decode ended at this step.
    Blocking. A request's codes do not depend on what else is in the batch (its own sampling
    and generator), up to float rounding of the batched predictor."""
    import torch

    results: list[list[int] | str] = []
    going: list[int] = []
    code0s: list[Any] = []
    hidden: list[Any] = []
    # inference mode: no autograd bookkeeping at all (~12% of a tiny step)
    with torch.inference_mode():
        for i, state in enumerate(states):
            if state.finished is not None:
                raise ValueError(f"request {i} of the step already finished ({state.finished})")
            picked = _code0(model, state)
            if picked is None:
                results.append(state.finished or "length")
                continue
            results.append([])
            going.append(i)
            code0s.append(picked[0])
            hidden.append(picked[1])
        if not going:
            return results
        chosen = [states[i] for i in going]
        residual, embeds = _residual_codes(model, chosen, code0s, hidden)
        for row, i in enumerate(going):
            state = states[i]
            results[i] = [int(code0s[row].item()), *residual[row].tolist()]
            x = embeds[row : row + 1].sum(1, keepdim=True)
            trailing = state.inputs.trailing_text
            k = state.step
            state.x = x + (
                trailing[:, k : k + 1] if k < trailing.shape[1] else state.inputs.tts_pad
            )
            state.step += 1
    return results


def talker_frames(
    model: Qwen3Talker, inputs: TalkerInputs, sampling: TalkerSampling
) -> Generator[list[int], None, str]:
    """Yield one frame (16 ints) per decode step as soon as it is known; blocking per step.
    Returns the finish reason: ``"stop"`` (the codec EOS) or ``"length"``.

    A frame's residual codes are predicted when its code 0 is fed back, so generation ends
    without a frame for the codec EOS (or for the last code 0 when ``max_new_tokens`` is
    reached), as in generate(). Stop between any two frames by closing the generator.
    """
    state = DecodeState(model, inputs, sampling)
    while True:
        (result,) = decode_step(model, [state])
        if isinstance(result, str):
            return result
        yield result


def load_talker(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Talker:
    """The talker of the Qwen-Omni checkpoint at ``path``, for its family, on ``device``.
    Blocking.
    Raises :class:`ConfigError` for a checkpoint of another architecture."""
    model_type = getattr(read_config(path), "model_type", None)
    if model_type == "qwen3_omni_moe":
        return Qwen3Talker.load(path, dtype, device)
    if model_type == "qwen2_5_omni":
        from .qwen25_talker import Qwen25Talker

        return Qwen25Talker.load(path, dtype, device)
    raise ConfigError(
        f"{path}: a talker stage runs Qwen-Omni checkpoints (model_type qwen3_omni_moe or "
        f"qwen2_5_omni), not model_type {model_type!r}"
    )
