"""Diagnostic (not part of the package): a plain 8 KiB hop in one thread, with an extra
step before the write and before the read (nothing, AES-GCM of 8 KiB or of 2,000 bytes,
four of 2,000, an 8 KiB copy); medians per stage (us). See 2026-12-08-sealing-4.md.
The AES calls seal a scratch buffer with a throwaway key (the nonce repeats: timing only).

    PYTHONPATH=. .venv/bin/python docs/journal/2026-12-08-sealing-4-after-effect.py
    OPENSSL_ia32cap=":~0x10000" PYTHONPATH=. .venv/bin/python docs/journal/...  # no AVX-512
"""
import os, socket, statistics, time, sys
import torch
torch.set_num_threads(1)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hetmesh.transport.codec import BufferPool
from hetmesh.transport.frames import DEFAULT_LIMITS, Activations, encode_parts
from hetmesh.transport.links import BufferedReader
pc = time.perf_counter_ns
A = AESGCM(os.urandom(32)); NON = b"\0"*12
size = 8192
frame = Activations(session_id="b", step=1, positions=(0,), tensors=(torch.ones(size // 4),))
S8 = memoryview(bytearray(8192+16)); S2 = memoryview(bytearray(2000+16)); D8 = memoryview(bytearray(8192))
def x_none(): pass
def x_aes8(): A.encrypt_into(NON, S8[:8192], None, S8)
def x_aes2(): A.encrypt_into(NON, S2[:2000], None, S2)
def x_aes2x4():
    for i in range(4): A.encrypt_into(NON, S2[:2000], None, S2)
def x_copy(): D8[:] = S8[:8192]
X = dict(none=x_none, aes8=x_aes8, aes2=x_aes2, aes2x4=x_aes2x4, copy=x_copy)
def run(x, n=3000):
    left, right = socket.socketpair()
    pool = BufferPool(); L = DEFAULT_LIMITS
    reader = BufferedReader(right, L, pool)
    T = {k: [] for k in "enc send fill pend rest".split()}
    for i in range(n):
        t0 = pc()
        head, buffers, total = encode_parts(frame, L)
        t1 = pc()
        x()
        left.sendmsg([head, *buffers])
        t3 = pc()
        x()
        reader._fill()
        t4 = pc()
        p = reader.read_pending()
        t5 = pc()
        buf, view = pool.acquire_view(p.specs[0])
        reader.read_into(view)
        f = p.build([buf])
        t8 = pc()
        pool.release(f.tensors[0])
        for k, a, b in zip(T, (t0,t1,t3,t4,t5), (t1,t3,t4,t5,t8)):
            T[k].append(b - a)
    left.close(); right.close()
    return {k: statistics.median(v[n//10:]) / 1e3 for k, v in T.items()}
res = {k: [] for k in X}
names = list(X)
for b in range(4):
    for s in (names if b % 2 == 0 else names[::-1]):
        res[s].append(run(X[s]))
for s in names:
    d = {k: round(statistics.median(r[k] for r in res[s]), 2) for k in res[s][0]}
    print(s, d)
print("load", os.getloadavg()[0])
