"""One request's stop strings as an Aho-Corasick automaton, shared by its ``n`` completions.

Owns the matching of many stop strings at once. Invariants: after reading a text from the
root, the state is the longest suffix of that text that is a prefix of some stop string (a trie
node), so reading one more character costs amortised O(1) whatever the number of stop strings;
a state knows in O(1) the stop string that ends there (the longest one, when several do) and
the longest suffix that is a *proper* prefix of a stop string (what streaming must hold back).
Built once in O(total stop length); immutable afterwards, so completions share it and keep
only their own state (two ints). Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

# Transitions live in one dict keyed by (state << _CHAR_BITS) | code point: one small-int key
# per trie edge instead of one dict per state (a request may bring thousands of states).
_CHAR_BITS = 21  # every Unicode code point is < 0x110000 < 2**21


class StopAutomaton:
    """The automaton of ``stops`` (non-empty strings; duplicates are harmless).

    States are ints, ``ROOT`` (0) is the empty text. ``step`` reads text and reports the first
    position where a stop string ends; ``depth``/``hold`` describe a state.
    """

    ROOT = 0
    __slots__ = ("stops", "max_len", "_goto", "_fail", "_depth", "_match", "_hold")

    def __init__(self, stops: Sequence[str]):
        self.stops: tuple[str, ...] = tuple(stops)
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"StopAutomaton: stop strings must be non-empty str, got {stops!r}")
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._goto: dict[int, int] = {}
        self._depth: list[int] = [0]
        self._match: list[int] = [-1]  # index into stops of the longest stop ending here
        children: list[list[tuple[int, int]]] = [[]]  # (code point, child): build-time only
        for index, s in enumerate(self.stops):
            node = self._insert(s, children)
            if self._match[node] < 0:
                self._match[node] = index
        self._fail = [0] * len(self._depth)
        self._hold = [0] * len(self._depth)
        self._link(children)

    def _insert(self, s: str, children: list[list[tuple[int, int]]]) -> int:
        goto, depth, match = self._goto, self._depth, self._match
        node, i = 0, 0
        while i < len(s):  # follow the part of s the trie already has
            nxt = goto.get((node << _CHAR_BITS) | ord(s[i]))
            if nxt is None:
                break
            node, i = nxt, i + 1
        for ch in s[i:]:  # the rest is a chain of new states
            c, nxt = ord(ch), len(depth)
            goto[(node << _CHAR_BITS) | c] = nxt
            children[node].append((c, nxt))
            children.append([])
            depth.append(depth[node] + 1)
            match.append(-1)
            node = nxt
        return node

    def _link(self, children: list[list[tuple[int, int]]]) -> None:
        """Failure links, matches and hold depths in breadth-first order (a state's failure
        target is shallower, so it is final when the state is reached)."""
        goto, fail, match = self._goto, self._fail, self._match
        hold, depth = self._hold, self._depth
        queue = deque([0])
        while queue:
            u = queue.popleft()
            # A state with children is a proper prefix of a stop string; one without is a
            # whole stop string that nothing extends, so it holds back what its suffix does.
            hold[u] = depth[u] if children[u] else hold[fail[u]]
            for c, v in children[u]:
                queue.append(v)
                if u == 0:
                    continue  # depth-1 states fail to the root
                f = fail[u]
                while True:
                    nxt = goto.get((f << _CHAR_BITS) | c)
                    if nxt is not None or f == 0:
                        break
                    f = fail[f]
                fail[v] = nxt if nxt is not None else 0
                if match[v] < 0:
                    match[v] = match[fail[v]]  # the longest stop that is a suffix of v's text

    @property
    def num_states(self) -> int:
        return len(self._depth)

    def depth(self, state: int) -> int:
        """Length of the text suffix ``state`` stands for."""
        return self._depth[state]

    def hold(self, state: int) -> int:
        """Length of the longest suffix of ``state``'s text that is a proper prefix of a stop
        string: text that may still turn into a stop, so it must not be streamed yet."""
        return self._hold[state]

    def step(self, state: int, text: str, lo: int, hi: int,
             report: bool = True) -> tuple[int, tuple[int, int] | None]:
        """Read ``text[lo:hi]`` from ``state``. Returns the state after it and, when ``report``,
        the first stop string that ends in that range as ``(end index in text, stop index)``
        (the longest one of those ending there), else None. Reads the whole range either way,
        so the state always describes the text up to ``hi``."""
        goto, fail, match = self._goto, self._fail, self._match
        found: tuple[int, int] | None = None
        node = state
        for i in range(lo, hi):
            c = ord(text[i])
            while True:
                nxt = goto.get((node << _CHAR_BITS) | c)
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            if report and found is None and match[node] >= 0:
                found = (i + 1, match[node])
        return node, found
