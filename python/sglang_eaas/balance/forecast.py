"""The next window's decode load, forecast from the routing of the requests now running.

Each running request gets a *profile*: the entries its own rows made per (MoE layer, expert) so
far, its prefill's (its prompt) and then its decode's (``RoutingBook``, fed by the client with
each step's rows and which request owns them). The forecast of the next ``steps`` decode steps
is ``steps * running * top_k`` entries per layer: each running request's tokens left in the
window spread as its own decode rows (a request keeps its experts; its recent rows weigh more,
``RECENT_DECAY``: a generation drifts), the rest (the requests still to start) as the decode
rows of the requests that started over the last ``steps`` steps spread theirs, each counted
alike once it decoded ``FULL_ROWS`` rows (in proportion to its rows before): the newest starters
are the mix now arriving, and a mix's decode tells its decode better than its prompts do
(``scripts/bench_forecast_bound.py``). Pooling their rows instead would weigh the starters by
the rows they decoded so far, so after a shift of the mix the old mix's longer-running starters
would outweigh the new ones for most of a window. Before any of them has decoded, it falls back
to the prompts: each running request's ``min(steps, remaining) * top_k`` spread as its own
profile, the rest as the newest prompts. Requests still in SGLang's queue have no routing yet
and are not in it; they show up at their prefill, a step after admission.

The servers count prefill entries too, and a prompt routes all its tokens at once: the entries
of the prompts to come (``coming_prefill``) are those of the prompts that started over the last
window, spread as they spread theirs. The balancer plans on the two summed.

Its accuracy is judged against what the window then computed: ``load_overlap`` (the share of the
window's decode entries on experts as often as forecast, ``balance/predictor.load_accuracy``'s
measure, per MoE layer) next to the same measure for the reactive guess (the last window's
entries, prefill and decode). docs/balancing.md, "Forecast", says what it costs and how close
it gets.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

MISSED = 2  # complete steps in a row a running request may be missing from before it leaves
ARRIVALS = 64  # requests whose prompt routing is kept to stand for the ones still to come
RECENT_ARRIVALS = 4  # at least so many of the latest stand for them, however long ago
FULL_ROWS = 8  # decode rows from which a starter's decode counts in full in the forecast
RECENT_DECAY = 0.9  # a running request's own decode rows in the forecast: each older row
# weighs this much less (about its last 10 rows: a generation drifts from the experts it began on)


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a step: ``rows`` consecutive token rows (after the previous
    request's), whether they are decode rows, the tokens it may still generate, and whether it
    ended with this step."""

    key: str  # SGLang's rid
    rows: int
    decode: bool
    remaining: int
    finished: bool = False


class RoutingBook:
    """Per running request, the entries its rows made per (MoE layer, expert); and the decode
    entries of all requests since the last ``take_decoded``.

    The client calls ``note`` with each MoE layer call's ``[T, K]`` expert ids and the row
    offset of those rows in the step (two-batch overlap sends a step in two micro-batches),
    then ``end_step`` with the step's requests in row order. ``forecast`` and ``take_decoded``
    may run on another thread. Profiles live in one ``[slots, L, E]`` array, a slot per running
    request, so a step costs one ``bincount`` and one indexed add whatever its size.
    """

    def __init__(self, layers: Sequence[int], num_experts: int, top_k: int,
                 forget_after: int = 256):
        self.layers, self.num_experts, self.top_k = tuple(layers), num_experts, top_k
        self.forget_after = forget_after  # steps a request may go unseen (retracted, aborted)
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._step: dict[int, list[tuple[int, np.ndarray]]] = {}  # layer -> (offset, ids)
        self._slot: dict[str, int] = {}  # running request -> its row of the arrays below
        self._free: list[int] = []
        self._counts = np.zeros((0, len(self.layers), num_experts), dtype=np.float32)
        self._remaining = np.zeros(0, dtype=np.int64)
        self._seen = np.zeros(0, dtype=np.int64)  # the last step each slot's request was in
        self._missed = np.zeros(0, dtype=np.int64)  # complete steps in a row it was not in
        self._started = np.zeros(0, dtype=bool)  # whether it decoded (its prompt is counted)
        self._start = np.zeros(0, dtype=np.int64)  # the step of its first decode
        self._decode_rows = np.zeros(0, dtype=np.int64)  # the decode rows it made so far
        # its decode entries, each row weighing RECENT_DECAY^(rows made since)
        self._recent = np.zeros((0, len(self.layers), num_experts), dtype=np.float32)
        self._prompt = np.zeros((0, len(self.layers), num_experts), dtype=np.float32)
        # the latest requests that ended: (their first decode, (decode entries [L, E], rows))
        self._ended: collections.deque[tuple[int, tuple[np.ndarray, int]]] = collections.deque(
            maxlen=ARRIVALS)
        # the latest requests' prompt entries [L, E], with the step of their first decode
        self._arrivals: collections.deque[tuple[int, np.ndarray]] = collections.deque(
            maxlen=ARRIVALS)
        self._decoded = np.zeros((len(self.layers), num_experts), dtype=np.int64)
        self._decode_steps = 0
        self.steps = 0
        self.unattributed = 0  # steps whose rows did not tile their requests' (left out)
        self.cost = 0.0  # seconds spent in end_step and forecast, all told
        self._ends: collections.deque[float] = collections.deque(maxlen=64)  # end_step times
        self._lock = threading.Lock()

    def note(self, layer: int, ids, row_offset: int = 0) -> None:
        """One MoE layer call's ``[T, K]`` global expert ids (< 0: none), rows from
        ``row_offset`` in the step: a numpy array, or a tensor on any device (read at
        ``end_step``)."""
        if layer in self._row:
            self._step.setdefault(layer, []).append((row_offset, ids))

    def end_step(self, requests: Sequence[StepRequest], complete: bool = False) -> None:
        """The step is over: its rows to their requests (``requests`` in row order).
        ``complete``: the step held every running request (SGLang's decode batch is its whole
        running batch), so a request missing from ``MISSED`` such steps in a row has ended
        (stopped at EOS, aborted) and leaves the book; one missing from one may just have
        prefilled (with the overlap scheduler a new request joins the running batch a step
        late). Otherwise requests leave when they end in a step, or after ``forget_after``
        steps unseen."""
        began = time.perf_counter()
        try:
            self._end_step(requests, complete)
        finally:
            ended = time.perf_counter()
            self._ends.append(ended)
            self.cost += ended - began

    def _end_step(self, requests: Sequence[StepRequest], complete: bool) -> None:
        step, self._step = self._step, {}
        self.steps += 1
        if not requests:
            return
        rows = sum(r.rows for r in requests)
        L, E, R = len(self.layers), self.num_experts, len(requests)
        layers = [self._row[layer] for layer in step]
        tiled = [_assemble([(offset, _host(ids)) for offset, ids in step[layer]])
                 for layer in step]
        if any(ids is None or len(ids) < rows for ids in tiled):
            self.unattributed += 1
            tiled = []
        # entries per (layer, request, expert): one bincount over (layer * R + request) * E + id
        counts = np.zeros((L, R, E), dtype=np.int64)
        if tiled:
            owner = np.repeat(np.arange(R), [r.rows for r in requests])
            ids = np.stack([t[:rows] for t in tiled]).astype(np.int64)  # rows past: padding
            index = (np.asarray(layers)[:, None, None] * R + owner[None, :, None]) * E + ids
            index = index[(ids >= 0) & (ids < E)]
            counts = np.bincount(index, minlength=L * R * E).reshape(L, R, E)
        decode = np.array([r.decode for r in requests], dtype=bool)
        with self._lock:
            slots = np.array([self._slot_of(r.key) for r in requests])
            for slot in slots[decode & ~self._started[slots]]:  # a first decode step: its
                self._started[slot] = True  # prompt's routing is what arrivals look like
                self._start[slot] = self.steps
                self._prompt[slot] = self._counts[slot]
                prompt = self._counts[slot].astype(np.float64)
                if prompt.any():
                    self._arrivals.append((self.steps, prompt))
            self._counts[slots] += counts.transpose(1, 0, 2)
            decoding = slots[decode]
            self._recent[decoding] = self._recent[decoding] * RECENT_DECAY \
                + counts[:, decode].transpose(1, 0, 2)
            self._decode_rows[decoding] += np.array(
                [r.rows for r in requests if r.decode], dtype=np.int64)
            self._remaining[slots] = [r.remaining for r in requests]
            self._seen[slots] = self.steps
            if tiled and decode.any():
                self._decoded += counts[:, decode].sum(axis=1)
                self._decode_steps += 1
            keys = {r.key for r in requests}
            for r in requests:
                if r.finished or r.remaining <= 0:
                    self._release(r.key)
            if complete:
                for key, slot in list(self._slot.items()):
                    if key in keys:
                        self._missed[slot] = 0
                        continue
                    self._missed[slot] += 1
                    if self._missed[slot] >= MISSED:
                        self._release(key)
            for key in [k for k, slot in self._slot.items()
                        if self.steps - self._seen[slot] > self.forget_after]:
                self._release(key)

    def _slot_of(self, key: str) -> int:
        slot = self._slot.get(key)
        if slot is not None:
            return slot
        if not self._free:  # grow by half (at least 16 slots)
            old = len(self._remaining)
            grow = max(16, old // 2)
            self._counts = np.concatenate([self._counts, np.zeros(
                (grow, *self._counts.shape[1:]), dtype=self._counts.dtype)])
            self._remaining = np.concatenate([self._remaining, np.zeros(grow, np.int64)])
            self._seen = np.concatenate([self._seen, np.zeros(grow, np.int64)])
            self._missed = np.concatenate([self._missed, np.zeros(grow, np.int64)])
            self._started = np.concatenate([self._started, np.zeros(grow, bool)])
            self._start = np.concatenate([self._start, np.zeros(grow, np.int64)])
            self._decode_rows = np.concatenate([self._decode_rows, np.zeros(grow, np.int64)])
            self._recent = np.concatenate([self._recent, np.zeros(
                (grow, *self._recent.shape[1:]), dtype=self._recent.dtype)])
            self._prompt = np.concatenate([self._prompt, np.zeros(
                (grow, *self._prompt.shape[1:]), dtype=self._prompt.dtype)])
            self._free = list(range(old + grow - 1, old - 1, -1))
        slot = self._slot[key] = self._free.pop()
        self._counts[slot] = 0
        self._missed[slot] = 0
        self._started[slot] = False
        self._decode_rows[slot] = 0
        self._recent[slot] = 0
        return slot

    def _release(self, key: str) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            if self._started[slot]:
                self._ended.append((int(self._start[slot]), self._decode_of(slot)))
            self._remaining[slot] = 0
            self._free.append(slot)

    def _decode_of(self, slot: int) -> tuple[np.ndarray, int]:
        """A started request's decode so far: the ``[L, E]`` entries of its rows, and its
        rows."""
        return ((self._counts[slot] - self._prompt[slot]).astype(np.float64),
                int(self._decode_rows[slot]))

    @property
    def running(self) -> int:
        return len(self._slot)

    def profile(self, key: str) -> np.ndarray | None:
        """``[L, E]``: the entries request ``key``'s rows made so far (None: not running)."""
        with self._lock:
            slot = self._slot.get(key)
            return None if slot is None else self._counts[slot].astype(np.int64)

    def forecast(self, steps: int) -> np.ndarray:
        """``[L, E]`` float64: the decode entries of the next ``steps`` steps, ``steps * running *
        top_k`` per layer (the tier keeps about as many requests running, the ones that end
        replaced): each running request's ``min(steps, remaining) * top_k`` spread as its own decode
        rows spread theirs (a request keeps its experts; each row weighing ``RECENT_DECAY`` less
        than the next; in proportion to its rows up to ``FULL_ROWS``, the rest of its share as the
        starters'), and the rest, the requests that will start, spread as the decode entries of the
        requests that started over the last ``steps`` steps (at least the latest
        ``RECENT_ARRIVALS``; running or ended) spread theirs, each alike from ``FULL_ROWS`` decode
        rows: a mix's decode is told best by that mix's decode (``bench_forecast_bound``: better
        than its prompts), and the newest starters are the mix now arriving. Right after a shift of
        the mix, the window is still partly the old mix's requests finishing, and the forecast says
        so.

        Before any of them decoded an entry, the older forecast: each running request's
        ``min(steps, remaining) * top_k`` spread as its own entries, the rest spread as the
        prompts of the requests that started over the last ``steps`` steps."""
        began = time.perf_counter()
        with self._lock:
            live = np.fromiter(self._slot.values(), dtype=np.int64)
            decode = self._recent_decode(steps, live)
            remaining = self._remaining[live]
            if decode is None:  # the fallback's inputs
                counts = self._counts[live].astype(np.float64)  # a copy: the step goes on
                arrivals = self._recent_arrivals(steps)
            else:
                own = [(self._recent[slot].astype(np.float64), int(self._decode_rows[slot]))
                       if self._started[slot] else None for slot in live]
        if decode is not None:
            starters = _starters_spread(decode)
            mine = np.zeros((len(own), len(self.layers), self.num_experts))
            held = np.zeros(len(own))
            for i, got in enumerate(own):
                if got is not None and got[0].any():
                    mine[i], held[i] = got[0], min(1.0, got[1] / FULL_ROWS)
            out = self._window(steps, _normalised(mine), held, remaining, starters)
        else:
            out = self._window(steps, _normalised(counts), np.ones(len(counts)), remaining,
                               _spread(arrivals) if arrivals else None)
        self.cost += time.perf_counter() - began
        return out

    def forecast_knowing(self, steps: int,
                         known: Callable[[str, int, int], np.ndarray | None]) -> np.ndarray:
        """``forecast`` with each running request's own decode to come as it will be:
        ``known(key, decode rows made, n)`` gives the ``[L, E]`` entries of its next ``n`` rows
        (None: not known; that request's tokens are then spread as the requests to come).
        Nothing serving knows that: it is the estimate of a measured bound
        (``balance/known_futures.py``)."""
        began = time.perf_counter()
        with self._lock:
            live = list(self._slot.items())
            slots = np.array([slot for _, slot in live], dtype=np.int64)
            done, remaining = self._decode_rows[slots].copy(), self._remaining[slots].copy()
            decode = self._recent_decode(steps, slots)
            arrivals = self._recent_arrivals(steps) if decode is None else None
        own = np.zeros((len(self.layers), self.num_experts))
        for (key, _), made, left in zip(live, done, remaining):
            entries = known(key, int(made), int(min(steps, left)))
            if entries is not None:
                own += entries
        out = self._filled(steps, len(live), own, _starters_spread(decode) if decode is not None
                           else _spread(arrivals) if arrivals else None)
        self.cost += time.perf_counter() - began
        return out

    def _window(self, steps: int, shares: np.ndarray, held: np.ndarray,
                remaining: np.ndarray, rest: np.ndarray | None) -> np.ndarray:
        """The window's ``steps * running * top_k`` entries per layer: the share ``held`` of
        each running request's ``min(steps, remaining) * top_k`` spread as its own ``shares``
        (``[R, L, E]``, each layer summing to 1 or 0), the rest of the window as ``rest``
        (None: left out)."""
        kept = np.minimum(steps, remaining).astype(np.float64) * self.top_k * held
        return self._filled(steps, len(held), np.einsum("r,rle->le", kept, shares), rest)

    def _filled(self, steps: int, running: int, out: np.ndarray, rest: np.ndarray | None
                ) -> np.ndarray:
        """``out`` (``[L, E]``, the running requests' own part) and the rest of the window's
        ``steps * running * top_k`` entries per layer spread as ``rest`` (None: left out)."""
        if rest is not None:
            out = out + np.maximum(0.0, steps * running * self.top_k
                                   - out.sum(axis=1))[:, None] * rest
        return out

    def _recent_decode(self, steps: int, live: np.ndarray
                       ) -> list[tuple[np.ndarray, int]] | None:
        """Under the lock: the ``[L, E]`` decode entries and the decode rows of each request
        whose first decode step was one of the last ``steps`` (running, or among the latest
        that ended); where fewer started then, of the latest ``RECENT_ARRIVALS``. None where
        they have none."""
        pool = [(int(self._start[slot]), self._decode_of(slot))
                for slot in live[self._started[live]]] + list(self._ended)
        recent = [d for d in self._latest(sorted(pool, key=lambda x: x[0]), steps)
                  if d[0].any()]
        return recent or None

    def coming_prefill(self, steps: int) -> np.ndarray:
        """``[L, E]`` float64: the prefill entries of the next ``steps`` steps, taken to be
        as many per layer as the prompts of the requests that started over the last ``steps``
        steps made, spread as those prompts spread theirs (at least the latest
        ``RECENT_ARRIVALS``')."""
        began = time.perf_counter()
        with self._lock:
            window = self._latest(self._arrivals, steps, at_least=0)
            arrivals = self._recent_arrivals(steps)
        out = np.zeros((len(self.layers), self.num_experts))
        if window:
            out = np.sum(window, axis=0).sum(axis=1, keepdims=True) * _spread(arrivals)
        self.cost += time.perf_counter() - began
        return out

    def _recent_arrivals(self, steps: int) -> list[np.ndarray]:
        """Under the lock: the prompt entries of the requests whose first decode step was
        one of the last ``steps``; where fewer started then, the latest ``RECENT_ARRIVALS``."""
        return self._latest(self._arrivals, steps)

    def _latest(self, started, steps: int, at_least: int = RECENT_ARRIVALS
                ) -> list[np.ndarray]:
        """Of ``started`` ((step of the first decode, value) in step order), the values of
        those that started in the last ``steps`` steps; where fewer than ``at_least`` did,
        the latest ``at_least``."""
        recent = [value for step, value in started if step > self.steps - steps]
        if len(recent) >= at_least:
            return recent
        return [value for _, value in list(started)[-at_least:]]

    def step_seconds(self) -> float | None:
        """The mean time between the last steps' ends (None before two)."""
        ends = list(self._ends)
        return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None

    def take_decoded(self) -> tuple[np.ndarray, int]:
        """The decode entries ``[L, E]`` since the last call, and the decode steps they came
        from; both reset."""
        with self._lock:
            decoded, self._decoded = self._decoded, np.zeros_like(self._decoded)
            steps, self._decode_steps = self._decode_steps, 0
        return decoded, steps


def _normalised(stacked: np.ndarray) -> np.ndarray:
    """``[R, L, E]`` entries, each request's layer normalised to sum 1 (0 where it has none)."""
    total = stacked.sum(axis=2, keepdims=True)
    return np.divide(stacked, total, out=np.zeros_like(stacked), where=total > 0)


def _spread(profiles: list[np.ndarray], weights: np.ndarray | None = None) -> np.ndarray:
    """``[L, E]``: the (``weights``-weighted) mean of the requests' entries, each normalised
    to sum 1 per layer (a request with none in a layer adds nothing there)."""
    return np.average(_normalised(np.stack(profiles)), axis=0, weights=weights)


def _starters_spread(decode: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """The starters' ``(decode entries [L, E], rows)`` spread alike, each in proportion to
    its rows up to ``FULL_ROWS``."""
    profiles, rows = zip(*decode)
    return _spread(list(profiles), np.minimum(1.0, np.array(rows) / FULL_ROWS))


def _host(ids) -> np.ndarray:
    """``ids`` as a host numpy array (the device path notes tensors: read once per step)."""
    return ids if isinstance(ids, np.ndarray) else ids.cpu().numpy()


def _assemble(parts: list[tuple[int, np.ndarray]]) -> np.ndarray | None:
    """A layer's rows of one step from its calls' ``(row offset, ids)``; None when they do not
    tile ``0 .. n`` (a layer called twice for the same rows, or a gap)."""
    parts = sorted(parts, key=lambda p: p[0])
    end = 0
    for offset, ids in parts:
        if offset != end:
            return None
        end += len(ids)
    return parts[0][1] if len(parts) == 1 else np.concatenate([ids for _, ids in parts])


def horizon_steps(horizon: float, step_seconds: float | None) -> int:
    """The steps in ``horizon`` seconds at ``step_seconds`` a step (1 before a step time is
    known)."""
    return max(1, round(horizon / step_seconds)) if step_seconds else 1


def load_overlap(predicted: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per MoE layer (rows of ``[L, E]``), ``1 - 0.5 * L1`` of the two loads normalised to sum
    1: the share of the actual entries on experts as often as predicted. NaN for a layer where
    either has no entries."""
    p, a = np.asarray(predicted, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    ps, as_ = p.sum(axis=1, keepdims=True), a.sum(axis=1, keepdims=True)
    ok = (ps[:, 0] > 0) & (as_[:, 0] > 0)
    out = np.full(len(p), np.nan)
    out[ok] = 1.0 - 0.5 * np.abs(p[ok] / ps[ok] - a[ok] / as_[ok]).sum(axis=1)
    return out


def requests_of_step(reqs: Iterable, extend: bool, extend_lens: Sequence[int] | None
                     ) -> list[StepRequest]:
    """The ``StepRequest``s of one SGLang batch: ``reqs`` (``ScheduleBatch.reqs``), whether it
    is an extend (prefill or mixed) batch and its ``extend_lens``. A request's rows in an
    extend batch are decode rows when it is one row of a request that has output already (a
    mixed batch's running requests)."""
    reqs = list(reqs)
    lens = list(extend_lens) if extend and extend_lens is not None else [1] * len(reqs)
    if len(lens) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(lens)} extend lengths")
    out = []
    for req, n in zip(reqs, lens):
        produced = len(getattr(req, "output_ids", ()) or ())
        limit = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
        remaining = max(0, (limit if limit is not None else 1 << 30) - produced)
        decode = not extend or (n == 1 and produced > 0)
        finished = bool(req.finished()) if hasattr(req, "finished") else False
        out.append(StepRequest(str(req.rid), int(n), decode, remaining, finished))
    return out
