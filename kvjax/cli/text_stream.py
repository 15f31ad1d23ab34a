"""``generate``'s text output, streamed as tokens arrive.

The prompts decode together, but their text is printed one prompt after another, as a reader
follows it: the first unfinished prompt's text streams as its tokens come; when it finishes, the
next prompt's text so far is printed at once and then streams. Each prompt's text is one block
headed ``prompt N (P tokens):``. Called as ``generate``'s ``on_step`` (after every scheduling
step); `finish` prints what is left once serving is done.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, TextIO

from kvjax.text import IncrementalText, TextTokenizer


class PromptTextStream:
    """Streams ``len(prompt_lengths)`` prompts' generated text to ``out`` in prompt order."""

    def __init__(self, tokenizer: TextTokenizer, prompt_lengths: Sequence[int], out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.lengths = list(prompt_lengths)
        self.texts = [IncrementalText(tokenizer) for _ in prompt_lengths]
        self.current = 0
        self._started = False

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def __call__(self, reqs: Sequence[Any]) -> None:
        """Print what the requests (``output_ids``, ``finished``; prompt order) added since the last call."""
        while self.current < len(self.lengths):
            req = reqs[self.current]
            if not self._started:
                self._write(f"prompt {self.current + 1} ({self.lengths[self.current]} tokens): ")
                self._started = True
            self._write(self.texts[self.current].push(req.output_ids))
            if not req.finished:
                return
            self._write(self.texts[self.current].flush() + "\n")
            self.current, self._started = self.current + 1, False

    def finish(self, outputs: Sequence[Sequence[int]]) -> None:
        """Print the rest of every prompt's text from the final ``outputs``."""
        self([SimpleNamespace(output_ids=list(ids), finished=True) for ids in outputs])
