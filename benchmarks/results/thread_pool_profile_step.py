import sys, time, os, statistics
import numpy as np
import lowmem
from lowmem.system import threads
depth, mode, bits, T = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
threads.configure(T)
net = lowmem.models.preact_resnet_cifar(depth, num_classes=10)
eng = lowmem.Engine(net, 128, (3, 32, 32), mode, bits, "float32")
opt = lowmem.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
rng = np.random.default_rng(0)
x = rng.standard_normal((128, 3, 32, 32)).astype(np.float32); y = rng.integers(0, 10, 128)
ts = []
for i in range(int(sys.argv[5]) if len(sys.argv) > 5 else 4):
    t = time.perf_counter(); eng.train_step(x, y, opt); ts.append(time.perf_counter() - t)
print(f"depth {depth} {mode}{bits if mode!='exact' else ''} T={threads.threads()}: first {ts[0]:.2f} median rest {statistics.median(ts[1:]):.2f} min {min(ts[1:]):.2f}  load {os.getloadavg()[0]:.1f}")
if len(sys.argv) > 6:
    import cProfile, pstats
    cProfile.run("eng.train_step(x, y, opt)", "/tmp/exp/prof")
    pstats.Stats("/tmp/exp/prof").sort_stats("tottime").print_stats(14)
