"""JAX's persistent compilation cache for warm starts: the folder, switching it on, and the hits it served.

A run that restarts, resumes or repeats a recipe traces its steps again but loads the compiled
executables from the cache instead of compiling them. :func:`enable_compilation_cache` points JAX
at the folder (``Trainer(compilation_cache=...)`` calls it), caches every compile however short,
and makes each cache entry appear whole or not at all: JAX writes entries in place, so a process
killed mid-write, or two processes writing the same entry, would leave a torn file that every later
run fails to read (and recompiles, with a warning). :data:`CACHE_STATS` counts the lookups and hits.

Example:
    >>> import tempfile
    >>> folder = enable_compilation_cache(tempfile.mkdtemp())
    >>> CACHE_STATS.hits >= 0
    True
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax

__all__ = ["CACHE_STATS", "CacheStats", "default_cache_folder", "enable_compilation_cache", "switch_on_at_import"]

_HIT = "/jax/compilation_cache/cache_hits"
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


class CacheStats:
    """Compiles that looked in the persistent cache (``requests``) and those it served (``hits``), process-wide."""

    def __init__(self) -> None:
        self.hits = 0
        self.requests = 0
        self._listening = False
        self._lock = threading.Lock()

    def listen(self) -> None:
        """Start counting (once per process), from JAX's monitoring events."""
        with self._lock:
            if self._listening:
                return
            self._listening = True
        jax.monitoring.register_event_listener(self._event)

    def _event(self, event: str, **_: Any) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _REQUEST:
            self.requests += 1


#: The process's counts.
CACHE_STATS = CacheStats()
_ours: str | None = None  # the folder this module set (any other was set by the user)


def default_cache_folder() -> str:
    """``$COMPOSERJAX_CACHE_DIR``, else ``composerjax/jax`` in the user cache folder (``$XDG_CACHE_HOME``, ~/.cache).

    Example:
        >>> default_cache_folder().endswith(os.path.join("composerjax", "jax")) or "COMPOSERJAX_CACHE_DIR" in os.environ
        True
    """
    if os.environ.get("COMPOSERJAX_CACHE_DIR"):
        return os.environ["COMPOSERJAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "composerjax", "jax")


_OFF = ("0", "false", "off", "no")


def switch_on_at_import() -> str | None:
    """Switch the cache on in the default folder unless ``$COMPOSERJAX_COMPILATION_CACHE`` is 0/false/off/no.

    ``import composerjax`` calls this, so the compiles that come before any Trainer (building
    and initialising the model compiles one small program per operation) are cached too. A folder
    that cannot be created leaves the cache off, silently here (a Trainer asking for it warns).

    Example:
        >>> switched_off = os.environ.get("COMPOSERJAX_COMPILATION_CACHE", "1").lower() in _OFF
        >>> switched_off or bool(jax.config.jax_compilation_cache_dir)
        True
    """
    if os.environ.get("COMPOSERJAX_COMPILATION_CACHE", "1").strip().lower() in _OFF:
        return None
    return enable_compilation_cache(True, quiet=True)


def enable_compilation_cache(setting: str | os.PathLike[str] | bool = True, *, quiet: bool = False) -> str | None:
    """Switch the persistent compilation cache on for this process; returns its folder (None: off).

    ``True`` uses :func:`default_cache_folder`, a path uses that folder. ``False`` switches off the
    cache this module switched on (at import, or an earlier call), for the rest of the process. A
    folder the user gave JAX itself (``jax_compilation_cache_dir``) is kept and returned, also for
    ``False``: the user's own setting wins. A folder that cannot be created leaves the cache off
    with a warning (none when ``quiet``).
    """
    global _ours
    configured = jax.config.jax_compilation_cache_dir
    if setting is False:
        if configured and configured == _ours:
            jax.config.update("jax_compilation_cache_dir", None)
            _ours = None
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
            return None
        if configured:
            CACHE_STATS.listen()
        return configured or None
    if configured and configured != _ours:
        CACHE_STATS.listen()
        return configured
    folder = os.path.abspath(os.fspath(default_cache_folder() if setting is True else setting))
    if folder == configured:
        return folder
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        if quiet:
            return None
        import warnings

        warnings.warn(f"compilation_cache={os.fspath(setting)!r}: cannot create {folder!r} ({error}); "
                      "compiling without the persistent cache", stacklevel=3)
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    # Every compile is worth keeping: a small model's train step compiles in well under JAX's 1 s default.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _ours = folder
    _use_whole_entries(folder)
    CACHE_STATS.listen()
    return folder


def _use_whole_entries(folder: str) -> None:
    """Have JAX read and write ``folder`` through :class:`_WholeEntryCache` from now on.

    JAX decides once per process whether the cache is in use (at its first compile, usually
    before a Trainer exists: building the model compiles), so its state is reset here. If this
    JAX keeps its cache elsewhere, its own cache serves the folder unchanged.
    """
    from jax._src import compilation_cache

    compilation_cache.reset_cache()
    try:
        from jax._src.lru_cache import LRUCache

        entry_cache = _whole_entry_cache(LRUCache)(folder, max_size=jax.config.jax_compilation_cache_max_size)
        with compilation_cache._cache_initialized_mutex:
            compilation_cache._cache = entry_cache
            compilation_cache._cache_initialized = True
    except (ImportError, AttributeError, TypeError):  # another JAX: its own cache, as configured above
        compilation_cache.reset_cache()


def _whole_entry_cache(base: type) -> type:
    class _WholeEntryCache(base):  # type: ignore[misc, valid-type]
        """JAX's file cache, each entry written to a temporary file and renamed into place."""

        def put(self, key: str, value: bytes) -> None:
            if getattr(self, "eviction_enabled", False):  # JAX's size-bounded cache holds a lock around its writes
                return super().put(key, value)
            path = os.path.join(os.fspath(self.path), f"{key}-cache")
            if os.path.exists(path):
                return None
            temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "wb") as file:
                file.write(value)
            os.replace(temporary, path)
            return None

    return _WholeEntryCache
