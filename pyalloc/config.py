"""Allocator configuration strings, with PyTorch's syntax, keys, defaults and reset rules.

A configuration string is a comma-separated list of ``key:value`` settings, for example
``expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:8]``.
It comes from the ``config=`` argument of ``CachingAllocator``, else from the first of
``ENV_VARS`` that is set, and can be changed at run time with :func:`set_allocator_settings`.

Every well-formed string PyTorch accepts means the same here. Differences, all deliberate:
  - diagnosed as ConfigError where PyTorch guesses or fails obscurely: a missing ``:`` or ``,``
    (PyTorch ignores separators), numbers that are not plain decimal (``std::stoull`` reads
    ``128abc`` as 128, ``-1`` as SIZE_MAX, ``+8`` as 8), a key given twice, an empty list ``[]``
    (PyTorch: all 0), and a ``>:M`` list entry that is not the last one;
  - ``backend:cudaMallocAsync`` is an error: pyalloc implements only the native allocator;
  - ``max_split_size_mb`` above SIZE_MAX / 1 MiB gives SIZE_MAX (unlimited, -1 in snapshots) where
    PyTorch stores (SIZE_MAX // 1 MiB) * 1 MiB; no allocation decision can tell them apart;
  - a failed parse changes nothing (PyTorch has already reset some settings and kept the string).
Whitespace separates nothing: it is dropped, even inside words, as PyTorch does, so
``max_split_size_mb:128 expandable_segments:True`` is an error (the value reads as
``128expandable_segments``); the message says so. A trailing ``,`` is accepted, as in PyTorch.

Classes: :class:`ConfigTokenizer` (tokens with positions, typed readers), :class:`AllocatorConfig`
(device-generic keys) and :class:`CudaAllocatorConfig` (adds the CUDA-only keys, reusing the
generic tokenizer and parse loop). Each key has one parse method, registered with ``@_parses``.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import threading
import types
import weakref
from collections.abc import Callable, Mapping

__all__ = [
    "SIZE_MAX", "MiB", "ROUNDUP_POWER2_INTERVALS", "ENV_VARS", "PYALLOC_ONLY_KEYS",
    "ConfigError", "ConfigTokenizer", "AllocatorConfig", "CudaAllocatorConfig",
    "config_from_environment", "resolve_config",
    "current_settings", "set_allocator_settings", "get_allocator_settings",
    "add_settings_listener", "remove_settings_listener",
]

SIZE_MAX = 2**64 - 1          # "unlimited" for byte sizes, as size_t's maximum in PyTorch
MiB = 1 << 20
LARGE_BUFFER = 20 * MiB       # kLargeBuffer: the floor of max_split_size, max_non_split_rounding
ROUNDUP_POWER2_INTERVALS = 16  # buckets for 1 MiB, 2 MiB, ... 32 GiB (the last covers all above)
MAX_REGISTER_THREADS = 128

# PYALLOC_CONF is ours and wins; then PyTorch's own order (CUDA-specific name first).
ENV_VARS = ("PYALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Keys of pyalloc's own, which PyTorch rejects: a setting string with one belongs in PYALLOC_CONF.
PYALLOC_ONLY_KEYS = ("graph_capture_last_use_marks", "graph_capture_cross_stream_reuse",
                     "recycle_pages", "event_poll_streams")

_SEPARATORS = ",:[]"
_GT_OUTSIDE_LIST = "'>' is only valid inside a list: roundup_power2_divisions:[...,>:M]"
_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class ConfigError(ValueError):
    """A malformed configuration string.

    Attributes: ``text`` (the whole string), ``position`` (character offset of the offending token;
    ``len(text)`` when the string ended too early), ``token`` (its text, '' at the end), ``reason``
    (what was expected) and ``source`` (the environment variable it came from, or None).
    """

    def __init__(self, text: str, position: int, token: str, reason: str,
                 source: str | None = None):
        self.text, self.position, self.token = text, position, token
        self.reason, self.source = reason, source
        origin = f" in {source}" if source else ""
        # Whitespace becomes a space so that the caret stays under the right character.
        shown = "".join(" " if c.isspace() else c for c in text)
        super().__init__(f"invalid allocator config{origin} {text!r}: {reason}\n"
                         f"    {shown}\n    {' ' * position}^")

    def __reduce__(self):  # the default would call __init__ with the message alone
        return type(self), (self.text, self.position, self.token, self.reason, self.source)


class ConfigTokenizer:
    """Splits a configuration string into tokens and reads typed values from them.

    Each of ``, : [ ]`` is a token of its own; all whitespace is dropped, even inside a word (as in
    PyTorch, so ``max_split _size_mb`` is one word); everything else accumulates into words. Each
    token keeps the character offsets where it starts and ends in the original string.
    """

    def __init__(self, text: str):
        self.text = text
        self._tokens: list[tuple[str, int, int]] = []   # (text, start, end), end exclusive
        word: list[str] = []
        start = end = 0
        for pos, char in enumerate(text):
            if char in _SEPARATORS:
                self._add_word(word, start, end)
                word = []
                self._tokens.append((char, pos, pos + 1))
            elif not char.isspace():
                if not word:
                    start = pos
                word.append(char)
                end = pos + 1
        self._add_word(word, start, end)

    def _add_word(self, word: list[str], start: int, end: int) -> None:
        if word:
            self._tokens.append(("".join(word), start, end))

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i: int) -> str:
        return self._tokens[i][0]

    def get(self, i: int) -> str | None:
        """Token ``i``, or None past the end."""
        return self._tokens[i][0] if i < len(self._tokens) else None

    def position(self, i: int) -> int:
        """Character offset of token ``i`` in the string (its length past the last token)."""
        return self._tokens[i][1] if i < len(self._tokens) else len(self.text)

    def error(self, i: int, reason: str) -> ConfigError:
        """A ConfigError pointing at token ``i`` (at the end of the string past the last token)."""
        if i >= len(self._tokens):
            return ConfigError(self.text, len(self.text), "", reason)
        token, start, end = self._tokens[i]
        if any(c.isspace() for c in self.text[start:end]):
            reason += f" (whitespace is ignored, so {self.text[start:end]!r} reads as {token!r})"
        return ConfigError(self.text, start, token, reason)

    def unexpected(self, i: int, expected: str) -> ConfigError:
        got = f"got {self[i]!r}" if i < len(self) else "reached the end of the config"
        return self.error(i, f"expected {expected} but {got}")

    def word(self, i: int, expected: str) -> str:
        """Token ``i``, which must be a word (not a separator, not past the end)."""
        token = self.get(i)
        if token is None or token in _SEPARATORS:
            raise self.unexpected(i, expected)
        return token

    def expect(self, i: int, separator: str, where: str = "") -> None:
        """Check that token ``i`` is ``separator`` (PyTorch ignores a missing separator)."""
        if self.get(i) != separator:
            raise self.unexpected(i, f"{separator!r}{where}")

    def size(self, i: int, what: str) -> int:
        """Token ``i`` as a non-negative decimal integer below 2**64 (``what`` names it)."""
        token = self.word(i, f"a non-negative integer for {what}")
        if not _DIGITS.fullmatch(token):
            raise self.unexpected(i, f"a non-negative integer for {what}")
        # Checked before int() also because int() refuses strings of more than 4300 digits.
        if len(token.lstrip("0")) > 20 or int(token) > SIZE_MAX:
            raise self.error(i, f"{what} is out of range (at most {SIZE_MAX}), got {token!r}")
        return int(token)

    def float(self, i: int, what: str) -> float:
        """Token ``i`` as a decimal floating-point number (``0.5``, ``.5``, ``5e-1``)."""
        token = self.word(i, f"a number for {what}")
        if not _NUMBER.fullmatch(token):  # float() alone would also take 'nan', 'inf', '1_0'
            raise self.unexpected(i, f"a number for {what}")
        return float(token)

    def bool(self, i: int, what: str = "the value") -> bool:
        """Token ``i`` as a bool: exactly ``True`` or ``False`` (case-sensitive, as in PyTorch)."""
        token = self.get(i)
        if token not in ("True", "False"):
            raise self.unexpected(i, f"'True' or 'False' for {what}")
        return token == "True"


def _is_side_key(key: str) -> bool:
    # Keys of pinned host memory and of ROCm: accepted, but rarely what a CUDA user mistyped.
    return key.startswith("pinned_") or "hip" in key


def _key_hint(key: str, known) -> str:
    """What to say about an unknown key: the known keys it starts, contains or resembles (at most
    three, nearest first), else the device allocator's keys (pinned_* and *hip* ones summarised),
    so that the message stays one readable line."""
    lowered = key.lower()
    near = [k for k in sorted(known) if lowered and (k.startswith(lowered) or lowered in k)]
    near += [k for k in difflib.get_close_matches(lowered, known, n=3) if k not in near]
    if near:
        near = near[:3]
        return "did you mean " + " or ".join(repr(k) for k in near) + "?"
    main = ", ".join(sorted(k for k in known if not _is_side_key(k)))
    return f"known keys: {main} (and pinned_* keys for host memory, *hip* ones for ROCm)"


def _parses(*keys: str):
    """Register the decorated method as the parser of ``keys`` (the first is canonical, the rest
    are aliases). A parser is called as ``method(self, tokenizer, i, key)`` with ``i`` the index
    of the value's first token; it sets attributes on ``self`` and returns the index after the
    value."""
    def mark(method):
        method._config_keys = keys
        return method
    return mark


def _bool_setting(key: str, *aliases: str):
    """The parser of a bool key whose attribute has the key's name."""
    @_parses(key, *aliases)
    def parse(self, tok: ConfigTokenizer, i: int, given_key: str) -> int:
        setattr(self, key, tok.bool(i, given_key))
        return i + 1
    return parse


class AllocatorConfig:
    """Device-generic allocator settings (PyTorch's ``AcceleratorAllocatorConfig``).

    Attributes (units are what the allocator core reads):
      max_split_size: bytes; blocks at least this big are never split. Default SIZE_MAX (unlimited).
      max_non_split_rounding_size: bytes; an oversize block is reused for a request only if it is
        at most this much bigger. Default 20 MiB.
      garbage_collection_threshold: fraction of the memory limit above which cached blocks are
        released; 0.0 (off) by default.
      roundup_power2_divisions: 16 ints, one per size bucket (1 MiB, 2 MiB, ... 32 GiB and above);
        0 means no power-of-two rounding for that bucket.
      expandable_segments, pinned_use_background_threads: bools, False by default.
      last_settings_string: the last string parsed, '' at first.

    ``parse`` is atomic and has PyTorch's reset rule: max_split_size, roundup_power2_divisions and
    garbage_collection_threshold return to their defaults unless the string sets them again; every
    other setting keeps its previous value. This class knows only the generic keys and rejects the
    others (a CUDA-only key is named as such); use CudaAllocatorConfig for a full string.
    """

    _DEFAULTS: dict[str, object] = {
        "max_split_size": SIZE_MAX,
        "max_non_split_rounding_size": LARGE_BUFFER,
        "garbage_collection_threshold": 0.0,
        "roundup_power2_divisions": [0] * ROUNDUP_POWER2_INTERVALS,
        "expandable_segments": False,
        "pinned_use_background_threads": False,
        "last_settings_string": "",
    }
    _RESET_ON_PARSE = ("max_split_size", "roundup_power2_divisions", "garbage_collection_threshold")
    _parsers: dict[str, tuple[Callable, str]] = {}   # key -> (parse method, canonical key)

    def __init__(self, text: str | None = None):
        """All defaults, then ``text`` parsed if given (ConfigError if it is malformed)."""
        for name, value in self._DEFAULTS.items():
            setattr(self, name, copy.copy(value))
        if text is not None:
            self.parse(text)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._register_keys()

    @classmethod
    def _register_keys(cls) -> None:
        # A subclass inherits its parent's keys and may add keys, never redefine one: two parsers
        # for one key would make its meaning depend on the class (PyTorch raises "Duplicated key").
        parsers = dict(cls._parsers)
        for method in vars(cls).values():
            keys = getattr(method, "_config_keys", ())
            for key in keys:
                if key in parsers:
                    raise TypeError(
                        f"allocator config key {key!r} registered twice ({cls.__name__})")
                parsers[key] = (method, keys[0])
        cls._parsers = parsers

    # -- the parse loop ---------------------------------------------------------------------------

    def parse(self, text: str) -> None:
        """Apply the settings in ``text``; on ConfigError nothing changes."""
        if not isinstance(text, str):
            raise TypeError(f"allocator config must be a str, not {type(text).__name__}")
        work = self.copy()
        for name in self._RESET_ON_PARSE:
            setattr(work, name, copy.copy(self._DEFAULTS[name]))
        work._apply(ConfigTokenizer(text))
        work.last_settings_string = text
        self.__dict__.update(work.__dict__)

    def _apply(self, tok: ConfigTokenizer) -> None:
        seen: dict[str, int] = {}   # canonical key -> position where it was first given
        i = 0
        while i < len(tok):
            key = tok.word(i, "a key")
            if key not in self._parsers:
                raise self._unknown_key(tok, i)
            method, canonical = self._parsers[key]
            if canonical in seen:
                raise tok.error(i, f"{key!r} is given twice (first at position {seen[canonical]})")
            seen[canonical] = tok.position(i)
            tok.expect(i + 1, ":", f" after {key!r}")
            try:
                i = method(self, tok, i + 2, key)
            except ConfigError as err:
                raise self._missing_comma_hint(err) from None
            if i < len(tok):
                tok.expect(i, ",", " between settings")
                i += 1   # a trailing comma is accepted, as PyTorch does

    def _unknown_key(self, tok: ConfigTokenizer, i: int) -> ConfigError:
        key = tok[i]
        if key == ">":
            return tok.error(i, _GT_OUTSIDE_LIST)
        for sub in _all_subclasses(type(self)):
            if key in sub._parsers:
                return tok.error(i, f"{key!r} is not a key of {type(self).__name__}; "
                                    f"it is handled by {sub.__name__}")
        return tok.error(i, f"unknown key {key!r}; {_key_hint(key, self._parsers)}")

    def _missing_comma_hint(self, err: ConfigError) -> ConfigError:
        # 'max_split_size_mb:128expandable_segments:True' fails on '128expandable_segments'; the
        # real mistake is the missing ',' before the key that the bad token ends with.
        for key in self._parsers:
            if err.token.endswith(key) and err.token != key:
                return ConfigError(err.text, err.position, err.token,
                                   f"{err.reason}; missing ',' before {key!r}?")
        return err

    # -- one parser per key -----------------------------------------------------------------------

    @staticmethod
    def _mib_at_least_20(tok: ConfigTokenizer, i: int, key: str) -> int:
        """A size in MiB, >= 20, converted to bytes; huge values clamp to SIZE_MAX (unlimited)."""
        mib = tok.size(i, f"{key} (MiB)")
        if mib < LARGE_BUFFER // MiB:
            raise tok.error(i, f"{key} too small, must be >= {LARGE_BUFFER // MiB}, got {mib}")
        return min(mib * MiB, SIZE_MAX)

    @_parses("max_split_size_mb")
    def _parse_max_split_size(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        self.max_split_size = self._mib_at_least_20(tok, i, key)
        return i + 1

    @_parses("max_non_split_rounding_mb")
    def _parse_max_non_split_rounding(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        self.max_non_split_rounding_size = self._mib_at_least_20(tok, i, key)
        return i + 1

    @_parses("garbage_collection_threshold")
    def _parse_garbage_collection_threshold(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        value = tok.float(i, key)
        if not 0.0 < value < 1.0:
            raise tok.error(i, f"{key} must be in (0.0, 1.0), got {tok[i]}")
        self.garbage_collection_threshold = value
        return i + 1

    @_parses("roundup_power2_divisions")
    def _parse_roundup_power2_divisions(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        if tok.get(i) == "[":
            return self._parse_roundup_list(tok, i + 1)
        if tok.get(i) == ">":
            raise tok.error(i, _GT_OUTSIDE_LIST)
        divisions = tok.size(i, key)
        if not _is_power_of_2(divisions):
            raise tok.error(i, f"{key}: the divisions has to be a power of 2, got {divisions}")
        self.roundup_power2_divisions = [divisions] * ROUNDUP_POWER2_INTERVALS
        return i + 1

    def _parse_roundup_list(self, tok: ConfigTokenizer, i: int) -> int:
        """``[N:M,...,>:M]`` from the token after ``[``. N is an interval start in MiB (a power of
        2; bucket log2(N), clamped to 0..15), M the divisions (0 or a power of 2). The first entry
        also fills every bucket below its own; ``>:M`` fills the buckets after the last explicit
        one and must come last. Buckets not covered stay 0."""
        divisions = [0] * ROUNDUP_POWER2_INTERVALS
        first, last_index = True, 0
        if tok.get(i) == "]":
            raise tok.error(i, "empty list: expected 'N:M' entries (N in MiB, M the divisions)")
        while True:
            interval = tok.word(i, "an interval start in MiB or '>'")
            tok.expect(i + 1, ":", f" after interval {interval!r}")
            value = tok.size(i + 2, "the divisions")
            if value and not _is_power_of_2(value):
                raise tok.error(i + 2, f"the divisions has to be a power of 2 or 0, got {value}")
            if interval == ">":
                divisions[last_index + 1:] = [value] * (ROUNDUP_POWER2_INTERVALS - 1 - last_index)
                if tok.get(i + 3) == ",":
                    raise tok.error(i, "'>:M' must be the last entry of the list")
                tok.expect(i + 3, "]", " to close the list")
                i += 3
                break
            start = tok.size(i, "an interval start (MiB)")
            if not _is_power_of_2(start):
                raise tok.error(i, f"the intervals have to be powers of 2 (MiB), got {start}")
            index = min(start.bit_length() - 1, ROUNDUP_POWER2_INTERVALS - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index], last_index = value, index
            i += 3
            if tok.get(i) == "]":
                break
            tok.expect(i, ",", " or ']' after a list entry")
            i += 1
            if tok.get(i) == "]":   # trailing comma, accepted as PyTorch does
                break
        self.roundup_power2_divisions = divisions
        return i + 1   # i is at the closing ']'

    _parse_expandable_segments = _bool_setting("expandable_segments")
    _parse_pinned_use_background_threads = _bool_setting("pinned_use_background_threads")

    # -- value behaviour --------------------------------------------------------------------------

    def roundup_power2_divisions_for(self, size: int) -> int:
        """The divisions that apply to a request of ``size`` bytes: bucket floor(log2(size)) - 20,
        clamped to 0..15 (so everything below 2 MiB uses bucket 0, 32 GiB and above bucket 15)."""
        if size < 0:
            raise ValueError(f"size must be >= 0 bytes, got {size}")
        index = min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_POWER2_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    def copy(self):
        """An independent copy (lists are not shared)."""
        other = object.__new__(type(self))
        other.__dict__ = {k: copy.copy(v) for k, v in self.__dict__.items()}
        return other

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None   # mutable

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({fields})"


AllocatorConfig._register_keys()


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


class CudaAllocatorConfig(AllocatorConfig):
    """AllocatorConfig plus the CUDA-only keys (PyTorch's ``CUDAAllocatorConfig``).

    Additional attributes:
      backend: always 'native' (pyalloc has no cudaMallocAsync backend; asking for it is an error).
      release_lock_on_cudamalloc: bool (alias key release_lock_on_hipmalloc), default False.
      pinned_use_cuda_host_register: bool (alias pinned_use_hip_host_register), default False.
      pinned_num_register_threads: int, a power of 2 <= 128, default 1.
      pinned_reserve_segment_size_mb: MiB, > 0 when given; default 0 (off).
      graph_capture_record_stream_reuse: bool, default False.
      graph_capture_last_use_marks: bool, default False (pyalloc only): free markers of a stream
        come from its last record_stream(..., last_use=True) mark in the capture, if any.
      graph_capture_cross_stream_reuse: bool, default False (pyalloc only): a whole segment freed
        in a capture may be reused on another stream of it once its markers precede that
        stream's terminals.
      recycle_pages: bool, default False (pyalloc only; acts with expandable_segments:True):
        physical pages are recycled between expandable segments. Pages are 2 MiB in both pools;
        when a segment grows, the whole pages of free blocks elsewhere are unmapped into a pool
        of physical pages that every map takes from before it creates memory. Reserved bytes
        count that pool; empty_cache and the out-of-memory ladder release it first.
      event_poll_streams: int, default 0 (pyalloc only): a malloc that a cached block serves
        polls the pending events of at most this many streams, in turn, instead of every
        stream's (a cache miss still polls them all first); 0 polls every stream, as PyTorch.
      per_process_memory_fraction: fraction of device memory in [0.0, 1.0], default 1.0.
    """

    _DEFAULTS = {
        **AllocatorConfig._DEFAULTS,
        "backend": "native",
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "pinned_num_register_threads": 1,
        "pinned_reserve_segment_size_mb": 0,
        "graph_capture_record_stream_reuse": False,
        "graph_capture_last_use_marks": False,
        "graph_capture_cross_stream_reuse": False,
        "recycle_pages": False,
        "event_poll_streams": 0,
        "per_process_memory_fraction": 1.0,
    }

    @_parses("backend")
    def _parse_backend(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        backend = tok.get(i)
        if backend in ("cudaMallocAsync", "hipMallocAsync"):
            raise tok.error(i, f"backend {backend!r} is not available: pyalloc implements only "
                               "the native backend")
        if backend != "native":
            raise tok.unexpected(i, "'native' or 'cudaMallocAsync' for backend")
        self.backend = backend
        return i + 1

    # ROCm builds of PyTorch spell these with 'hip'; both spellings are accepted, as PyTorch does.
    _parse_release_lock = _bool_setting("release_lock_on_cudamalloc", "release_lock_on_hipmalloc")
    _parse_host_register = _bool_setting(
        "pinned_use_cuda_host_register", "pinned_use_hip_host_register")
    _parse_graph_capture_reuse = _bool_setting("graph_capture_record_stream_reuse")
    # pyalloc's own keys (PyTorch rejects them: put them in PYALLOC_CONF); not in snapshots.
    _parse_graph_last_use = _bool_setting("graph_capture_last_use_marks")
    _parse_graph_cross_stream = _bool_setting("graph_capture_cross_stream_reuse")
    _parse_recycle_pages = _bool_setting("recycle_pages")

    @_parses("event_poll_streams")
    def _parse_event_poll_streams(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        streams = tok.size(i, f"{key} (streams)")
        if streams >= 1 << 32:
            raise tok.error(i, f"{key}: streams polled per malloc must be below 2**32, got {streams}")
        self.event_poll_streams = streams
        return i + 1

    @_parses("pinned_num_register_threads")
    def _parse_pinned_num_register_threads(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        threads = tok.size(i, key)
        if not _is_power_of_2(threads):
            raise tok.error(
                i, f"{key}: number of register threads has to be a power of 2, got {threads}")
        if threads > MAX_REGISTER_THREADS:
            raise tok.error(i, f"{key}: number of register threads should be less than or equal "
                               f"to {MAX_REGISTER_THREADS}, got {threads}")
        self.pinned_num_register_threads = threads
        return i + 1

    @_parses("pinned_reserve_segment_size_mb")
    def _parse_pinned_reserve_segment_size(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        mib = tok.size(i, f"{key} (MiB)")
        if mib == 0:
            raise tok.error(i, f"{key}: pinned reserve segment size has to be greater than 0")
        self.pinned_reserve_segment_size_mb = mib
        return i + 1

    @_parses("per_process_memory_fraction")
    def _parse_per_process_memory_fraction(self, tok: ConfigTokenizer, i: int, key: str) -> int:
        fraction = tok.float(i, key)
        if not 0.0 <= fraction <= 1.0:
            raise tok.error(i, f"{key} must be in [0.0, 1.0], got {tok[i]}")
        self.per_process_memory_fraction = fraction
        return i + 1

    def to_snapshot_dict(self) -> dict:
        """The ``allocator_settings`` dict of a PyTorch memory snapshot, same keys and shapes."""
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.last_settings_string,
            "max_split_size": -1 if self.max_split_size == SIZE_MAX else self.max_split_size,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": self.pinned_num_register_threads,
            "release_lock_on_cudamalloc": self.release_lock_on_cudamalloc,
            "pinned_use_cuda_host_register": self.pinned_use_cuda_host_register,
            "graph_capture_record_stream_reuse": self.graph_capture_record_stream_reuse,
            "roundup_power2_divisions": {
                str(1 << k): d for k, d in enumerate(self.roundup_power2_divisions)},
        }


# -- where settings come from ----------------------------------------------------------------------

def config_from_environment(environ: Mapping[str, str] | None = None) -> CudaAllocatorConfig:
    """Settings from the first variable of ENV_VARS that is set (even to ''), without merging;
    all defaults when none is set. ``environ`` defaults to ``os.environ``."""
    environ = os.environ if environ is None else environ
    for name in ENV_VARS:
        if name in environ:
            try:
                return CudaAllocatorConfig(environ[name])
            except ConfigError as err:
                raise ConfigError(
                    err.text, err.position, err.token, err.reason, source=name) from None
    return CudaAllocatorConfig()


def resolve_config(config: str | CudaAllocatorConfig | None = None) -> CudaAllocatorConfig:
    """The settings for a new allocator. ``config`` may be None (read the environment), a string
    (parsed onto the defaults; the environment is then ignored) or a CudaAllocatorConfig
    (copied)."""
    if config is None:
        return config_from_environment()
    if isinstance(config, str):
        return CudaAllocatorConfig(config)
    if isinstance(config, CudaAllocatorConfig):
        return config.copy()
    raise TypeError(
        f"config must be None, a str or a CudaAllocatorConfig, not {type(config).__name__}")


# -- process-wide runtime settings (torch.cuda.memory._set_allocator_settings) ---------------------

_lock = threading.RLock()        # guards the two globals below; held briefly
_set_lock = threading.RLock()    # orders whole set_allocator_settings calls, notifications included
_process_settings: CudaAllocatorConfig | None = None
_listeners: list[weakref.ref] = []   # weak, so that a registered allocator can still be collected
_dead_listeners = 0                  # entries of _listeners whose listener died since the last prune


def _listener_died(ref) -> None:
    # A weakref callback runs wherever the collector or a decref happens to free the listener,
    # possibly while this thread iterates _listeners under _lock: it only counts, and
    # add_settings_listener prunes, so that registering allocator after allocator (each dropped)
    # keeps the list at most twice the live listeners instead of growing by one entry each.
    global _dead_listeners
    _dead_listeners += 1


def current_settings() -> CudaAllocatorConfig:
    """The process-wide settings object, created from the environment on first use."""
    global _process_settings
    with _lock:
        if _process_settings is None:
            _process_settings = config_from_environment()
        return _process_settings


def set_allocator_settings(text: str) -> None:
    """Parse ``text`` into the process-wide settings (reset rule as in AllocatorConfig.parse), then
    call every live listener with its own copy of the new settings. ConfigError leaves them
    unchanged and notifies no one. If a listener raises, the settings stay applied, the other
    listeners are still called, and the first error is re-raised."""
    # _set_lock makes concurrent calls notify in the order they parsed, so no allocator ends up
    # with older settings; _lock is not held while listeners run, so they may call back in here.
    with _set_lock:
        with _lock:
            settings = current_settings()
            settings.parse(text)
            snapshot = settings.copy()
            _listeners[:] = [ref for ref in _listeners if ref() is not None]
            listeners = [ref() for ref in _listeners]
        first_error = None
        for listener in listeners:
            if listener is None:
                continue
            try:
                listener(snapshot.copy())
            except Exception as err:   # noqa: BLE001 -- every listener must hear of the change
                first_error = first_error or err
        if first_error is not None:
            raise first_error


def get_allocator_settings() -> str:
    """The last settings string parsed into the process-wide settings ('' if none)."""
    return current_settings().last_settings_string


def add_settings_listener(listener: Callable[[CudaAllocatorConfig], object]) -> None:
    """Call ``listener(settings)`` after each set_allocator_settings. Only a weak reference is
    kept (WeakMethod for bound methods): the caller keeps the listener alive."""
    global _dead_listeners
    is_method = isinstance(listener, types.MethodType)
    ref = (weakref.WeakMethod(listener, _listener_died) if is_method
           else weakref.ref(listener, _listener_died))
    with _lock:
        if 2 * _dead_listeners >= len(_listeners) > 0:
            _listeners[:] = [r for r in _listeners if r() is not None]
            _dead_listeners = 0
        _listeners.append(ref)


def remove_settings_listener(listener: Callable[[CudaAllocatorConfig], object]) -> None:
    """Stop notifying ``listener`` (no error if it was not registered)."""
    with _lock:
        _listeners[:] = [ref for ref in _listeners if ref() not in (None, listener)]
