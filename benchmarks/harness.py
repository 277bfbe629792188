"""The benchmarks' harness: each measured configuration in a fresh process, its peak memory, a
quiet machine, and the machine named.

A worker is this repository's Python running a benchmark script with `--worker ...`: it builds
its configuration, measures, and prints one line `RESULT {json}` (result_line). The parent
(run_supervised) starts it, watches it and reads that line back:

    sup = Supervision.from_args(args)             # --max-busy, --max-wait, --max-others, --retries, ...
    res = run_supervised(cmd, sup, log)           # waits for a quiet machine, reruns a disturbed run
    res["other_cpus_during"], res["status"]       # what the parent saw; the worker's RESULT keys

Peak memory (in the worker): rss_now() before building, reset_peak() (the kernel's high-water mark
set to the resident size now, where /proc/self/clear_refs allows it), then rss_peak() - base
after the work is everything it added to the process. The parent kills a worker that passes
--mem-limit, leaves the machine less than 1 GiB available, or runs past --timeout.

A quiet machine: before each timed worker the parent waits (up to --max-wait s) until the CPUs
are less than --max-busy busy over 2 s (/proc/stat); during the run it counts the CPUs other
processes used, and reruns a run that others disturbed (more than --max-others CPUs, up to
--retries times; the earlier attempts kept). On 2 cores one busy neighbour slows multi-threaded
PyTorch and OpenBLAS/numba many times over.

Rounds (rotated): round r runs the configurations in an order rotated by r, so a drift in the
machine's speed hits each alike; a configuration's figure is the median of its rounds' medians.

machine_info() / machine_line(): the CPU model, its vector extensions (AVX2, AVX-512), cores
and CPUs, memory, the libraries and the thread environment: figures mean nothing without them.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
OPENBLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
              "NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "LOWMEM_THREADS")


# ---- /proc: memory and CPUs ----------------------------------------------------------------

def proc_status(pid="self"):
    """{'VmRSS': bytes, 'VmHWM': bytes} of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def rss_now():
    """This process's resident bytes now."""
    return proc_status()["VmRSS"]


def rss_peak():
    """This process's peak resident bytes (since the last reset_peak(), else since it started)."""
    return proc_status()["VmHWM"]


def reset_peak():
    """Set the peak (VmHWM) to the resident size now; False where the kernel does not allow it
    (then rss_peak() is the peak since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def cpu_times():
    """(all jiffies, busy jiffies) summed over the machine's CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return sum(v), sum(v) - v[3] - v[4]


def proc_cpu(pid):
    """utime + stime jiffies of a process and its waited-for children."""
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in v[11:15])


def cpu_busy(seconds=2.0):
    """Fraction of all CPUs busy over `seconds` (the caller sleeps meanwhile)."""
    t0, b0 = cpu_times()
    time.sleep(seconds)
    t1, b1 = cpu_times()
    return (b1 - b0) / max(1, t1 - t0)


def parse_bytes(text):
    """argparse type: '21GiB', '512MiB', ... (lowmem's own parser)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from lowmem.tools.maxbatch import parse_bytes as parse
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fmt_mib(b):
    return "-" if b is None else f"{b / MiB:,.0f}"


# ---- the machine ---------------------------------------------------------------------------

def cpu():
    """The CPU model (/proc/cpuinfo's model name, else platform.processor()) and the CPU count."""
    name = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def isa(flags):
    """The widest float vector extension among /proc/cpuinfo's (or lscpu's) flags."""
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "AVX" if "avx" in flags else "SSE"


def blas_info():
    """The BLAS libraries loaded in this process (threadpoolctl if installed, else numpy's build)."""
    try:
        import threadpoolctl
        return [{k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads", "filepath")}
                for d in threadpoolctl.threadpool_info()]
    except ImportError:
        import numpy
        cfg = numpy.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        return [{"internal_api": cfg.get("name"), "version": cfg.get("version"),
                 "architecture": "(threadpoolctl not installed)", "num_threads": None,
                 "filepath": cfg.get("openblas configuration")}]


def machine_info():
    """What the figures ran on: CPU model, vector extensions, cores (physical, from lscpu) and
    CPUs, memory, library versions, BLAS, and the thread environment variables."""
    info = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "cpu": cpu().rsplit(",", 1)[0]}
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for key in ("Model name", "Core(s) per socket", "Socket(s)", "Thread(s) per core", "L3 cache"):
            m = re.search(rf"^{re.escape(key)}:\s*(.+)$", out, re.M)
            if m:
                info[key] = m.group(1).strip()
        m = re.search(r"^Flags:\s*(.+)$", out, re.M)
        flags |= set(m.group(1).split()) if m else set()
    except OSError:
        pass
    info["isa"] = isa(flags)
    info["avx2"], info["avx512f"] = "avx2" in flags, "avx512f" in flags
    try:
        info["cores"] = int(info["Core(s) per socket"]) * int(info.get("Socket(s)", 1))
    except (KeyError, ValueError):
        info["cores"] = None
    with open("/proc/meminfo") as f:
        info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    import numpy
    info["numpy"] = numpy.__version__
    info["blas"] = blas_info()
    from importlib import metadata
    for pkg in ("torch", "numba", "threadpoolctl"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    info["env"] = {k: os.environ.get(k) for k in OPENBLAS_ENV + THREAD_ENV}
    return info


def machine_line(info):
    """'AMD EPYC 7B13, AVX-512 (AVX2 too), 2 cores (2 CPUs), 23.5 GiB RAM'."""
    ext = info["isa"] + (" (AVX2 too)" if info["isa"] == "AVX-512" and info["avx2"] else "")
    cores = f"{info['cores']} cores" if info.get("cores") else "cores unknown"
    return f"{info['cpu']}, {ext}, {cores} ({info['cpus']} CPUs), {info['mem_total_gib']} GiB RAM"


def libraries_line(info):
    blas = "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']}, {b['num_threads']} threads)"
                     for b in info["blas"])
    env = ", ".join(f"{k}={v}" for k, v in info["env"].items() if v is not None) or "none set"
    return (f"python {info['python']}, numpy {info['numpy']}, torch {info['torch']}, numba {info['numba']}; "
            f"numpy BLAS: {blas}\nthread / BLAS environment: {env}")


def source_hash():
    """sha256 (12 hex) of the lowmem sources this process imported: the code measured
    (the work tree may change between runs)."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(m for m in sys.modules if m == "lowmem" or m.startswith("lowmem.")):
        path = getattr(sys.modules[name], "__file__", None)
        if path:
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


# ---- the worker's side ---------------------------------------------------------------------

def result_line(res):
    """Print the worker's result for the parent (one line, flushed)."""
    print("RESULT " + json.dumps(res), flush=True)


def read_result(stdout):
    """The worker's RESULT dict from its output, or None."""
    res = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    return res


# ---- the parent's side ---------------------------------------------------------------------

@dataclass
class Supervision:
    """How the parent runs timed workers (the command-line flags of add_arguments)."""
    max_busy: float = 0.25
    max_wait: float = 1200
    max_others: float = 0.3
    retries: int = 2
    mem_limit: int = 21 << 30
    timeout: float = 3600

    @classmethod
    def from_args(cls, args):
        return cls(args.max_busy, args.max_wait, args.max_others, args.retries, args.mem_limit, args.timeout)


def add_arguments(ap):
    """The supervision flags, for a benchmark's argparse parser."""
    d = Supervision()
    ap.add_argument("--mem-limit", type=parse_bytes, default=d.mem_limit,
                    help="kill a worker whose RSS passes this (default: 21GiB)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="kill a worker after this many s")
    ap.add_argument("--max-busy", type=float, default=d.max_busy,
                    help="wait before each worker until CPU busy (all cores, 2 s sample) is below this")
    ap.add_argument("--max-wait", type=float, default=d.max_wait,
                    help="longest wait for a quiet machine, s (0: never wait)")
    ap.add_argument("--max-others", type=float, default=d.max_others,
                    help="rerun a run when other processes used more CPUs than this during it")
    ap.add_argument("--retries", type=int, default=d.retries, help="reruns of a disturbed run (default: %(default)s)")


def wait_quiet(sup, log):
    """Wait until the CPUs are quiet (or sup.max_wait has passed); return what was seen."""
    t0 = time.time()
    while True:
        busy = cpu_busy()
        load = os.getloadavg()
        if busy < sup.max_busy or time.time() - t0 > sup.max_wait:
            waited = time.time() - t0
            quiet = busy < sup.max_busy
            if not quiet:
                log(f"  machine still busy ({busy:.0%} CPU, load {load[0]:.2f}) after {waited:.0f} s: "
                    f"measuring anyway (recorded)")
            return dict(cpu_busy_before=round(busy, 3), load_before=[round(v, 2) for v in load],
                        waited_s=round(waited, 1), quiet=quiet)
        time.sleep(10)


def run_fresh(cmd, sup, env=None):
    """Run cmd in a fresh process under the memory watchdog. Returns (stdout, stderr, returncode,
    watch): watch has the largest RSS seen, why it was killed (or None), the CPUs busy on average
    during the run and how many of them were other processes' (the worker's own time is its
    last reading, up to 50 ms short; the parent's is negligible), and the wall time."""
    t0 = time.time()
    all0, busy0 = cpu_times()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    max_rss, killed, own = 0, None, 0
    while p.poll() is None:
        try:
            rss = proc_status(p.pid).get("VmRSS", 0)
            own = proc_cpu(p.pid)
        except (OSError, ValueError, IndexError):
            rss = 0
        max_rss = max(max_rss, rss)
        avail = mem_available()
        if rss > sup.mem_limit or (avail is not None and avail < 1 << 30) or time.time() - t0 > sup.timeout:
            why = ("RSS limit" if rss > sup.mem_limit else
                   "timeout" if time.time() - t0 > sup.timeout else "MemAvailable < 1 GiB")
            killed = f"killed ({why}) at RSS {rss / MiB:.0f} MiB after {time.time() - t0:.0f} s"
            p.kill()
            break
        time.sleep(0.05)
    out, err = p.communicate()
    all1, busy1 = cpu_times()
    ncpu = os.cpu_count()
    busy_cpus = ncpu * (busy1 - busy0) / max(1, all1 - all0)
    own_cpus = ncpu * own / max(1, all1 - all0)
    watch = dict(load_after=[round(v, 2) for v in os.getloadavg()], watched_max_rss=max_rss, killed=killed,
                 cpus_busy_during=round(busy_cpus, 2), other_cpus_during=round(max(0.0, busy_cpus - own_cpus), 2),
                 wall_s=round(time.time() - t0, 1))
    return out, err, p.returncode, watch


def run_supervised(cmd, sup, log, timed=True, env=None, label="", done=None):
    """Run cmd (a worker) in a fresh process: after wait_quiet when timed; then again (up to
    sup.retries times) while other processes used more than sup.max_others CPUs during it.
    Returns the worker's RESULT dict (or {}) updated with what the parent saw and "status":
    done(res) says whether the worker finished ("ok"); else the status names the failure.
    Earlier, disturbed attempts are kept under "disturbed_attempts". timed=False (memory
    only): once, without waiting for a quiet machine."""
    done = done or (lambda r: "step_s" in r)
    disturbed = []
    while True:
        seen = (wait_quiet(sup, log) if sup.max_wait > 0 and timed
                else {"load_before": [round(v, 2) for v in os.getloadavg()]})
        out, err, code, watch = run_fresh(cmd, sup, env)
        res = read_result(out) or {}
        killed = watch.pop("killed")
        res.update(seen, **watch)
        if done(res):
            res["status"] = "ok"
        else:
            tail = err.strip().splitlines()[-1:] or [""]
            res["status"] = res.get("status") if res.get("status") not in (None, "ok") else \
                killed or f"failed (exit {code}): {tail[0][-500:]}"
        if not timed or res["status"] != "ok" or res["other_cpus_during"] <= sup.max_others \
                or len(disturbed) >= sup.retries:
            break
        log(f"  {label}: other processes used {res['other_cpus_during']:.2f} CPUs during the run; retrying")
        res.pop("profile", None)
        disturbed.append(res)
    if disturbed:
        res["disturbed_attempts"] = disturbed
    return res


def rotated(names, r):
    """Round r's order: names rotated left by r."""
    k = r % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def median_of_medians(rounds, key="step_median"):
    """The median over rounds of each round's median (rounds: result dicts that have `key`)."""
    return statistics.median(r[key] for r in rounds)
