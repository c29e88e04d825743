"""memory.keep_freed_memory: glibc keeps freed memory, so a large tensor allocated again reuses its
pages without page faults; LONGPATCH_KEEP_FREED_MEMORY=0 leaves the allocator alone. Each case runs in
its own process (the setting is process-wide and cannot be undone)."""
import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, torch
from longpatch import memory
applied = memory.keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # 64 MB: above glibc's largest mmap threshold
del x
f0 = faults()
# 60 MB: a tensor somewhat smaller than the freed one always fits its chunk; one of the same size may not
# (the aligned allocation asks for a few bytes more, and a small live block may sit after the freed chunk)
y = torch.ones(15 << 20)
print(json.dumps({"applied": applied, "again": memory.keep_freed_memory(), "faults": faults() - f0,
                  "allocator": memory.allocator()}))
"""


def _probe(**env):
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    got = _probe(LONGPATCH_KEEP_FREED_MEMORY="1")
    assert got["applied"] and got["again"] and "kept" in got["allocator"]
    assert got["faults"] < 15360 // 4, got  # 60 MB is 15360 pages of 4 KB: nearly all reused


def test_the_switch_leaves_the_allocator_alone():
    got = _probe(LONGPATCH_KEEP_FREED_MEMORY="0")
    assert not got["applied"] and not got["again"] and got["allocator"] == "as the process started"
