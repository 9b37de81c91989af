"""Peak memory of the actor processes during a refit (same machine: read ``/proc/<pid>/status``)."""

from __future__ import annotations


def _reset_peak(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status(pid: int) -> dict[str, int]:
    """Memory lines of ``/proc/<pid>/status`` in bytes (VmHWM, VmRSS, RssAnon, RssFile, RssShmem)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class MemorySampler:
    """Samples the private + file-backed RSS (``RssAnon + RssFile``: heap, tensors, the memory-mapped
    baseline; not the pages of Ray's shared-memory object store that a worker maps) of some processes
    every ``interval_s`` in a background thread (``start``: the first sample), and reads their ``VmHWM`` (reset
    at start) at the end."""

    def __init__(self, pids: list[int], interval_s: float = 0.02):
        import threading

        self.pids, self.interval_s = list(pids), interval_s
        self.peak = {p: 0 for p in self.pids}
        self.hwm: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        for p in self.pids:
            st = _status(p)
            self.peak[p] = max(self.peak[p], st.get("RssAnon", 0) + st.get("RssFile", 0))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "MemorySampler":
        for p in self.pids:
            _reset_peak(p)
        self._sample()
        self.start = dict(self.peak)  # RSS as the refit begins: peak - start is what the refit added
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.hwm = {p: _status(p).get("VmHWM", 0) for p in self.pids}
