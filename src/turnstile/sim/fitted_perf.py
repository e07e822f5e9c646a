"""The fitted step-time model: coefficients fitted to step times measured on a real engine.

:class:`FittedPerf` prices an engine iteration (the four features of
:class:`~turnstile.sim.perf.PerfModel`) as ``b0 + b1·prefill + b2·decode + b3·kv_read + b4·attn2``,
plus an optional small-chunk attention term ``b5``, for engines that run one iteration as several
forward passes (micro-batches), a fixed cost per pass (:func:`forward_passes`), and for engines
whose caches go cold, a cold-step cost priced by the engine profile's
:class:`~turnstile.sim.engine_profile.WarmRule`; :func:`turnstile.sim.profile_fit.fit_profile` fits
it by non-negative least squares and :meth:`FittedPerf.to_profile` / :meth:`FittedPerf.from_profile`
store it as a ``turnstile-profile`` JSON file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from turnstile.sim.engine_profile import WarmRule, profile_for
from turnstile.sim.perf import FEATURES

PROFILE_FORMAT = "turnstile-profile"
#: version 2 added the ``tiles`` small-chunk rule, version 3 the cold-step cost; a build that
#: reads only older versions refuses a newer file instead of pricing its steps by another model
PROFILE_VERSION = 3
#: the versions this build reads
PROFILE_VERSIONS_READ = (1, 2, 3)

#: how the small-chunk attention term fades with the step's prefill tokens ``p`` (knee or
#: threshold ``k``): ``knee``, smoothly, ``k / (k + p)``; ``below``, at once: all of it while
#: ``p < k``, none from ``k`` on (an attention kernel that switches to a tiled kernel from ``k``
#: query tokens on: the engine profile's ``attention_tile_tokens``); ``tiles``, as ``below``, and
#: from ``k`` on the attention is priced by the ``k × k`` tiles the tiled kernel computes
#: (:func:`tile_pairs`) instead of by the causal pairs
SMALL_CHUNK_RULES = ("knee", "below", "tiles")

#: how an engine cuts one iteration's tokens into forward passes of at most ``ubatch_tokens``
#: (the engine profile's ``ubatch_split``): ``simple``, in batch order (one KV buffer for all
#: sequences); ``equal``, the same number of tokens from every sequence in a pass, from a run of
#: consecutive slots (one KV stream per slot: :mod:`turnstile.sim.lanes`)
UBATCH_SPLITS = ("simple", "equal")


def forward_passes(
    prefill_tokens: float, decode_seqs: float, ubatch_tokens: int, split: str
) -> tuple[int, int]:
    """``(passes of two or more tokens, passes of one token)`` of an iteration with
    ``decode_seqs`` decoders (one token each) and ``prefill_tokens`` prompt tokens, as the
    engine cuts it into forward passes of at most ``ubatch_tokens`` (0: one pass, uncut).

    The prompt tokens are taken to be one sequence's (one prefill chunk per iteration, the
    common case), on the slot after the decoders'. With the ``equal`` split a step mixing decodes
    and a prefill is (at least) two passes: one token of every sequence, then the prompt's other
    tokens. (This is :func:`turnstile.sim.lanes.equal_split_passes` in closed form for that
    layout, which is what the profile's probes measure; an engine model that knows its
    requests' slots counts the passes of any layout with it.) A pass of one token is
    counted apart: a CPU engine runs it as matrix-vector products, several times cheaper than
    the matrix products of two tokens (the one-token pass cost of :class:`FittedPerf`).
    Fractional arguments (the mean step of a multi-step sample) are rounded."""
    p = round(prefill_tokens)
    d = round(decode_seqs)
    total = p + d
    if total <= 0:
        return 0, 0
    if ubatch_tokens <= 0:
        return (0, 1) if total == 1 else (1, 0)
    if split == "equal" and p and d:
        multi, one, rest = 1, 0, p - 1
    else:
        multi, one, rest = 0, 0, total
    full, tail = divmod(rest, ubatch_tokens)
    multi += full  # ubatch_tokens >= 2
    if tail == 1:
        one += 1
    elif tail:
        multi += 1
    return multi, one


def tile_pairs(prefill_tokens: float, attn_pairs: float, tile: int) -> float:
    """The attention pairs a tiled flash-attention kernel computes for a chunk of ``p =
    prefill_tokens`` query tokens whose causal pairs are ``attn_pairs`` (so after ``c =
    (attn_pairs − p(p+1)/2) / p`` computed tokens), with query and KV tiles of ``tile`` tokens:
    a query tile is padded to ``tile`` rows and reads every KV tile its last row reaches
    (wholly masked tiles are skipped), so it computes ``tile² · Σ_j ⌈(c + min(tile·(j+1), p)) /
    tile⌉`` pairs, ``j`` over the ``⌈p / tile⌉`` query tiles: 65 query tokens run as two full
    tiles of 64, about as long as 128 (an engine profile's ``attention_tile_tokens`` names the
    tile of an engine that has such a kernel).

    Taken as one chunk: a step with several is priced chunk by chunk where the engine model
    says what they are (:meth:`FittedPerf.step_time`'s ``prompts``, :func:`chunk_tile_pairs`);
    micro-batches of a multiple of ``tile`` tokens cut no tile.
    """
    p = prefill_tokens
    if p <= 0:
        return 0.0
    c = (attn_pairs - p * (p + 1) / 2) / p
    return chunk_tile_pairs(p, c if c > 0 else 0.0, tile)


def chunk_tile_pairs(tokens: float, context: float, tile: int) -> float:
    """The attention pairs the tiled kernel computes for ``tokens`` query tokens after
    ``context`` computed ones (see :func:`tile_pairs`)."""
    q_tiles = math.ceil(tokens / tile - 1e-9)
    kv_tiles = ((q_tiles - 1) * math.ceil(context / tile - 1e-9) + q_tiles * (q_tiles - 1) / 2
                + math.ceil((context + tokens) / tile - 1e-9))
    return float(tile * tile) * kv_tiles


@dataclass(slots=True)
class FittedPerf:
    """``step_time = b0 + b1·prefill + b2·decode + b3·kv_read + b4·attn2`` (all ``b ≥ 0``),
    plus, when fitted, a small-chunk attention term ``b5·attn2·k/(k + prefill)``.

    With ``ubatch_tokens`` set the step is several forward passes (:func:`forward_passes`) and
    ``b0`` is paid once per pass; with ``b0_one`` set a pass of one token pays ``b0_one``
    instead: an engine that cuts an iteration into micro-batches, per slot when each slot has
    its own KV stream (so a step where decoders meet a newcomer's prompt is two passes, each
    paying the weights), and on a CPU runs a one-token pass (a lone decoder) as matrix-vector
    products, cheaper than a two-token pass (the engine profile's ``ubatch_tokens``,
    ``ubatch_split``, ``one_token_pass``).

    The extra term is what a CPU engine shows: a prefill chunk of a few tokens
    appended to a long cached context pays more per attention pair than a large chunk (the
    attention runs as matrix-vector products instead of a tiled matrix product), so each pair
    costs ``b4 + b5`` when the step's prefill is much smaller than the knee ``k``
    (``small_chunk_tokens``) and ``b4`` when much larger. With ``small_chunk_rule = "below"`` the
    switch is a threshold instead, as in the engine's kernels: ``b4 + b5`` while the prefill is
    under ``k`` tokens, ``b4`` from ``k`` on. ``b5 = 0`` is the linear model.

    With ``cold_step_s`` a step that starts with the engine's caches cold pays that much more;
    ``warm`` says which steps run warm (default: the rule of the engine profile that
    ``engine`` names; a cold-step cost needs one).
    """

    b0: float
    b1: float = 0.0
    b2: float = 0.0
    b3: float = 0.0
    b4: float = 0.0
    kv_bytes_per_token: float = 0.0
    engine: str = ""
    model: str = ""
    measured_at: str = ""
    #: fit diagnostics and provenance (samples, rmse_s, r2, hardware...)
    meta: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    #: extra seconds per attention pair of a small prefill chunk (0: the linear model)
    b5: float = 0.0
    #: the knee ``k`` of the small-chunk term, in prefill tokens per step
    small_chunk_tokens: float = 0.0
    #: how the small-chunk term fades past ``k`` (:data:`SMALL_CHUNK_RULES`)
    small_chunk_rule: str = "knee"
    #: fixed seconds of a forward pass that computes one token (None: ``b0``)
    b0_one: float | None = None
    #: the most tokens one forward pass computes (the micro-batch); 0: a step is one pass
    ubatch_tokens: int = 0
    #: how a step is cut into passes (:data:`UBATCH_SPLITS`)
    ubatch_split: str = "simple"
    #: with the ``equal`` split, count a step's passes from its requests' slots when the engine
    #: model tracks them (:attr:`lane_ubatch`); False prices every step as if its decoders held
    #: slots ``0..k-1`` and its prompt the next one, the layout the profile measures
    slot_passes: bool = True
    #: how much longer a step takes per other engine on the same host stepping at the same time
    #: (engines sharing a CPU's cores, caches and memory bandwidth: CPU engines on one
    #: machine); 0.05 = 5% per co-running engine. Measured by ``turnstile profile --neighbour``;
    #: the simulator applies it among the engines of one group (see ``sim.cluster``)
    host_contention: float = 0.0
    #: extra seconds of a step that starts with the engine's caches cold (see ``warm``; 0:
    #: every step warm, the model before it was measured). Fitted by ``turnstile profile``
    #: from appends sent right after a generation against the same appends after a prefill
    cold_step_s: float = 0.0
    #: which steps run warm (None: the engine profile's rule, when ``cold_step_s`` is set)
    warm: WarmRule | None = None
    _passes: bool = field(default=False, init=False, repr=False, compare=False)
    _tiles: bool = field(default=False, init=False, repr=False, compare=False)
    _per_chunk: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"fitted:{self.engine or '?'}/{self.model or '?'}"
        if self.small_chunk_rule not in SMALL_CHUNK_RULES:
            raise ValueError(f"small_chunk_rule must be one of {SMALL_CHUNK_RULES}, "
                             f"got {self.small_chunk_rule!r}")
        if self.ubatch_split not in UBATCH_SPLITS:
            raise ValueError(f"ubatch_split must be one of {UBATCH_SPLITS}, "
                             f"got {self.ubatch_split!r}")
        if not (self.cold_step_s >= 0 and math.isfinite(self.cold_step_s)):
            raise ValueError(f"cold_step_s must be finite and >= 0, got {self.cold_step_s}")
        if self.cold_step_s and self.warm is None:
            self.warm = profile_for(self.engine).warm
            if self.warm is None:
                raise ValueError(
                    f"cold_step_s needs a warm rule: the engine profile of {self.engine!r} "
                    "has none (name a profiled engine, or pass warm=WarmRule(...))")
        if not (self.host_contention >= 0 and math.isfinite(self.host_contention)):
            raise ValueError(f"host_contention must be finite and >= 0, "
                             f"got {self.host_contention}")
        if self.ubatch_tokens < 0 or self.ubatch_tokens == 1:
            raise ValueError(f"ubatch_tokens must be 0 (uncut) or >= 2, got {self.ubatch_tokens}")
        if self.small_chunk_rule == "tiles" and self.small_chunk_tokens < 1:
            raise ValueError(f"the tiles rule needs a tile of >= 1 tokens, "
                             f"got {self.small_chunk_tokens}")
        self._passes = bool(self.ubatch_tokens) or self.b0_one is not None
        self._tiles = self.small_chunk_rule == "tiles"
        # a threshold picks a kernel per sequence, so a step's chunks are priced one by one
        self._per_chunk = self._tiles or (self.small_chunk_rule == "below" and self.b5 > 0
                                          and self.small_chunk_tokens > 0)

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.b0, self.b1, self.b2, self.b3, self.b4)

    def scaled(self, factor: float) -> FittedPerf:
        """The same engine ``factor`` times slower (every time term scaled): e.g. an engine
        whose CPU the serving stack shares (:class:`turnstile.calibrate.ab.ServingTerms`)."""
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return replace(self, b0=self.b0 * factor, b1=self.b1 * factor, b2=self.b2 * factor,
                       b3=self.b3 * factor, b4=self.b4 * factor, b5=self.b5 * factor,
                       b0_one=None if self.b0_one is None else self.b0_one * factor,
                       cold_step_s=self.cold_step_s * factor,
                       meta={**self.meta, "scaled": factor})

    @property
    def lane_ubatch(self) -> int:
        """The micro-batch size by which the engine cuts a step per run of consecutive slots
        (the ``equal`` split), so that the engine model tracks its requests' slots and
        passes :meth:`step_time` the step's forward passes (:mod:`turnstile.sim.lanes`); 0 when
        the passes do not depend on the slots."""
        return self.ubatch_tokens if self.ubatch_split == "equal" and self.slot_passes else 0

    def step_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        kv_read_tokens: int,
        prefill_attn_tokens2: float = 0.0,
        passes: tuple[int, int] | None = None,
        prompts: Sequence[tuple[int, int]] | None = None,
    ) -> float:
        if passes is not None or self._passes:
            if passes is None:
                passes = forward_passes(prefill_tokens, decode_seqs, self.ubatch_tokens,
                                        self.ubatch_split)
            multi, one = passes
            fixed = self.b0 * multi + (self.b0 if self.b0_one is None else self.b0_one) * one
        else:
            fixed = self.b0
        if prompts is not None and self._per_chunk:
            return (fixed + self.b1 * prefill_tokens + self.b2 * decode_seqs
                    + self.b3 * kv_read_tokens + self._chunk_attention(prompts))
        if self._tiles:
            k = self.small_chunk_tokens
            if prefill_tokens < k:
                attn = (self.b4 + self.b5) * prefill_attn_tokens2
            else:
                attn = self.b4 * tile_pairs(prefill_tokens, prefill_attn_tokens2, int(k))
            return (fixed + self.b1 * prefill_tokens + self.b2 * decode_seqs
                    + self.b3 * kv_read_tokens + attn)
        t = (
            fixed
            + self.b1 * prefill_tokens
            + self.b2 * decode_seqs
            + self.b3 * kv_read_tokens
            + self.b4 * prefill_attn_tokens2
        )
        if self.b5:
            k = self.small_chunk_tokens
            if self.small_chunk_rule == "knee":
                t += self.b5 * prefill_attn_tokens2 * k / (k + prefill_tokens)
            elif prefill_tokens < k:
                t += self.b5 * prefill_attn_tokens2
        return t

    def _chunk_attention(self, prompts: Sequence[tuple[int, int]]) -> float:
        """The attention time of a step's prompt chunks ``(n, c)``, each by the kernel its own
        ``n`` query tokens pick (the threshold rules): all its pairs at ``b4 + b5`` under the
        threshold, from it on at ``b4``, counted in tiles with the ``tiles`` rule."""
        k = self.small_chunk_tokens
        small = self.b4 + self.b5
        tile = int(k) if self._tiles else 0
        t = 0.0
        for n, c in prompts:
            if n < k:
                t += small * (n * c + n * (n + 1) / 2)
            elif tile:
                t += self.b4 * chunk_tile_pairs(n, c, tile)
            else:
                t += self.b4 * (n * c + n * (n + 1) / 2)
        return t

    # -- profile files -------------------------------------------------------------------------

    def to_profile(self, path: str | Path) -> None:
        doc = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "engine": self.engine,
            "model": self.model,
            "measured_at": self.measured_at,
            "features": list(FEATURES),
            "coefficients": {
                "b0_s": self.b0,
                "b1_s_per_prefill_token": self.b1,
                "b2_s_per_decode_seq": self.b2,
                "b3_s_per_kv_read_token": self.b3,
                "b4_s_per_attn_pair": self.b4,
                "b5_s_per_small_chunk_attn_pair": self.b5,
                "small_chunk_tokens": self.small_chunk_tokens,
                "small_chunk_rule": self.small_chunk_rule,
                "b0_one_token_pass_s": self.b0_one,
                "host_contention_per_engine": self.host_contention,
                "cold_step_s": self.cold_step_s,
                **({"warm_rule": {"gap_s": self.warm.gap_s, "steps": self.warm.steps,
                                  "max_prefill_tokens": self.warm.max_prefill}}
                   if self.warm is not None and self.cold_step_s else {}),
            },
            "forward_passes": {"ubatch_tokens": self.ubatch_tokens, "split": self.ubatch_split},
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "meta": self.meta,
        }
        Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")

    @classmethod
    def from_profile(cls, path: str | Path) -> FittedPerf:
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{p}: not a {PROFILE_FORMAT} file (missing 'format' header)")
        if doc.get("version") not in PROFILE_VERSIONS_READ:
            raise ValueError(
                f"{p}: {PROFILE_FORMAT} version {doc.get('version')!r} is not supported "
                f"(this build reads versions {', '.join(map(str, PROFILE_VERSIONS_READ))})"
            )
        c = doc.get("coefficients", {})
        keys = (
            "b0_s",
            "b1_s_per_prefill_token",
            "b2_s_per_decode_seq",
            "b3_s_per_kv_read_token",
            "b4_s_per_attn_pair",
        )
        if "b0_s" not in c:
            raise ValueError(f"{p}: coefficients.b0_s is required")
        b = [float(c.get(k, 0.0)) for k in keys]
        if any(v < 0 or not math.isfinite(v) for v in b):
            raise ValueError(f"{p}: coefficients must be finite and non-negative, got {b}")
        b5 = float(c.get("b5_s_per_small_chunk_attn_pair", 0.0))
        knee = float(c.get("small_chunk_tokens", 0.0))
        rule = str(c.get("small_chunk_rule", "knee"))
        if b5 < 0 or knee < 0 or not (math.isfinite(b5) and math.isfinite(knee)):
            raise ValueError(f"{p}: the small-chunk term must be finite and non-negative")
        b0_one = c.get("b0_one_token_pass_s")
        if b0_one is not None and (float(b0_one) < 0 or not math.isfinite(float(b0_one))):
            raise ValueError(f"{p}: b0_one_token_pass_s must be finite and non-negative")
        passes = doc.get("forward_passes") or {}
        try:
            wr = c.get("warm_rule")  # written since the rule moved to the engine profiles;
            # older files take the profile's, which the rule they were fitted under was
            warm = None if not isinstance(wr, dict) else WarmRule(
                float(wr["gap_s"]), int(wr["steps"]), int(wr["max_prefill_tokens"]))
            return cls(
                b0=b[0], b1=b[1], b2=b[2], b3=b[3], b4=b[4],
                b5=b5 if knee > 0 else 0.0,
                small_chunk_tokens=knee,
                small_chunk_rule=rule,
                b0_one=None if b0_one is None else float(b0_one),
                ubatch_tokens=int(passes.get("ubatch_tokens", 0)),
                ubatch_split=str(passes.get("split", "simple")),
                host_contention=float(c.get("host_contention_per_engine", 0.0)),
                cold_step_s=float(c.get("cold_step_s", 0.0)),
                warm=warm,
                kv_bytes_per_token=float(doc.get("kv_bytes_per_token", 0.0)),
                engine=str(doc.get("engine", "")),
                model=str(doc.get("model", "")),
                measured_at=str(doc.get("measured_at", "")),
                meta=dict(doc.get("meta", {})),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{p}: {exc}") from None
