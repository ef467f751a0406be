"""Prefill in slices: a request's prefill runs until it has spent its share of a step's tokens, then pauses.

A scheduler step runs the decoding token of every running request plus prefill work, up to `max_step_tokens`
tokens in all (vLLM's chunked prefill with `max_num_batched_tokens`). kvsieve slices a prefill
between decoder layers instead of between tokens: layer j of a forward pass over t tokens costs
t / num_layers of the step's tokens, and the prefill pauses before the first layer that would overrun
it. Every forward pass of every stage is sliced the same way (GemFilter's early-layer pass and
its short second pass, a chunked feed's chunks, the one-pass feed, CritiPrefill's attention), and
since a pause changes no computation, a sliced prefill gives exactly the tokens an unsliced one
does: no method has to be re-derived for chunks of the prompt. A pause holds one layer's
hidden states (t x hidden), far less than the KV cache it builds.

The prefill runs in a greenlet (a coroutine with its own stack and its own copy of the context
variables of where the request was made, so the attention hooks it sets never leak into the
decoding steps run between its slices). A
forward pre-hook on every decoder layer (`install`) charges the layer to the running slice and
switches back to the scheduler when the slice is spent.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import greenlet
import torch
from transformers import PreTrainedModel

from kvsieve.models import architecture

_running: ContextVar[PrefillSlices | None] = ContextVar("kvsieve_prefill_slice", default=None)
_HOOKED = "_kvsieve_slice_hooks"


def install(model: PreTrainedModel) -> None:
    """Add the slicing pre-hook to every decoder layer of `model` (once; a no-op outside a slice)."""
    if getattr(model, _HOOKED, False):
        return
    for layer in architecture(model).layers:
        layer.register_forward_pre_hook(_before_layer, with_kwargs=True)
    setattr(model, _HOOKED, True)


def _before_layer(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    running = _running.get()
    if running is not None:
        hidden = args[0] if args else kwargs["hidden_states"]
        running.charge(hidden.shape[0] * hidden.shape[1])


class PrefillSlices:
    """Runs `work()` in slices of a step's tokens; `advance(tokens)` runs the next slice.

    `done` turns true when `work` has returned (its value in `result`); an exception raised by
    `work` is raised by the `advance` that ran into it.
    """

    def __init__(self, model: PreTrainedModel, work: Callable[[], Any]):
        install(model)
        self.layers = architecture(model).num_layers
        self.done = False
        self.result: Any = None
        self.spent = 0.0  # tokens charged in the current slice
        self._left = float("inf")
        self._greenlet: greenlet.greenlet | None = greenlet.greenlet(self._main)
        # A copy of the creator's context, as an asyncio task gets: hooks active where the request was
        # made (a caller's attention_hooks) apply to its prefill; what the prefill sets stays its own.
        self._greenlet.gr_context = contextvars.copy_context()
        self._work = work

    def _main(self) -> None:
        _running.set(self)  # this greenlet's own context: decoding steps outside it see no slice
        self.result = self._work()
        self.done = True

    def advance(self, tokens: float | None) -> float:
        """Run until `tokens` tokens are charged (None: to the end); return the tokens charged.

        A slice always runs at least one layer, so every call makes progress.
        """
        self._left = float("inf") if tokens is None else tokens
        self.spent = 0.0
        self._greenlet.parent = greenlet.getcurrent()  # pauses return to whoever advanced the slice
        try:
            self._greenlet.switch()
        finally:
            if self._greenlet.dead:
                self._release()
        return self.spent

    def close(self) -> None:
        """Abandon an unfinished prefill (a cancelled request): unwind it now, so what it holds is freed now."""
        if self._greenlet is not None and self._greenlet:  # started and not finished
            self._greenlet.throw()  # GreenletExit: its `with` blocks exit, its tensors are released
        self._release()

    def _release(self) -> None:
        """Drop the greenlet and the work: they refer to each other and to the request, a cycle that would
        keep the request's caches alive until the garbage collector runs."""
        self._greenlet = self._work = None

    def charge(self, tokens: int) -> None:
        """Called before a decoder layer over `tokens` tokens: pause first if the slice cannot pay for it."""
        cost = tokens / self.layers
        if self.spent > 0 and cost > self._left:
            self._greenlet.parent.switch()  # back to `advance`'s caller; resumes here on the next slice
        self._left -= cost
        self.spent += cost
