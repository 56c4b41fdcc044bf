"""A store move still in flight when the interpreter exits must not hang the exit.

``concurrent.futures`` stops the store's copy threads at interpreter exit, before ``atexit``
handlers and ``weakref.finalize`` callbacks (which is where the engine closes its store). A swap-in
completing after that used to lose its completion, and ``close()`` then waited for it forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import sys, time, weakref
    import torch
    from infinity.io import Swapper
    from infinity.tiers import StoreConfig, Tier, TieredStore

    swapper = Swapper(sys.argv[1])
    store = TieredStore("cpu", StoreConfig(device_budget_bytes=1 << 20, host_budget_bytes=1 << 20),
                        swapper=swapper)
    data = torch.arange(4096, dtype=torch.float32)
    store.register("w", 4096, torch.float32, Tier.NVME, initial=data)
    store.flush()
    store.evict("w", Tier.HOST)

    real_move = swapper._move
    def slow_move(op, *args):  # a slow disk: the read ends after the main thread has exited
        if op.kind != "out":
            time.sleep(1.0)
        return real_move(op, *args)
    swapper._move = slow_move

    class Owner:  # closes the store at exit, like the engine's finalizer
        pass
    owner = Owner()
    def close():
        store.close()
        swapper.close()
        print("closed", flush=True)
    weakref.finalize(owner, close)
    handle = store.fetch("w", Tier.DEVICE)
    print("exiting", flush=True)
""")


def test_exit_with_a_move_in_flight_does_not_hang(tmp_path):
    script = tmp_path / "exit_in_flight.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "swap")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["exiting", "closed"], (proc.stdout, proc.stderr)
