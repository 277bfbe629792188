"""Everything a training step depends on, saved to one checkpoint and restored from it exactly.

    state = TrainState(net, opt, batches, rng)                # the live objects of a Trainer
    save(path, state, config, data_info)                    # atomically; refuses non-finite values
    arrays, meta = load_checkpoint(path)
    check_resumable(meta, config, data_info, path, log)     # ResumeError naming what differs
    restore(state, arrays, meta, path)                      # ResumeError / CheckpointError

What a checkpoint holds (lowmem.train.checkpoint's file; meta["format"] = FORMAT):
  arrays  net/<name>        parameters and BN running statistics
          momentum/<name>   the SGD momentum buffers
  meta    config            the TrainConfig fields
          data              what travels with the weights: class names (label order),
                            input shape, image size, normalisation mean/std (pixel / 255)
          iteration, epoch  steps done; `epoch` is iteration / steps per epoch
          optimizer         SGD.state_dict(); rng: the augmentation RNG's bit_generator.state
          batches           the data order's position (lowmem.data.batches.EpochOrder.state_dict)
          epoch_sums        the running epoch's loss, correct, seen, time (a mid-epoch stop)
          last_eval         the last evaluation, or null
          architecture      a network read from an ONNX file (--model PATH.onnx): its layer
                            records (core.network.network_records), so resume, predict and export
                            rebuild the network the run trained, whatever the file holds later

Resume is exact: the learning rate is a function of the iteration, the data
order of (seed, epoch, batch), the augmentation of the saved RNG; so on
NumPy a run stopped at a step boundary and resumed ends with bitwise the
parameters of an uninterrupted run. Every failure raises: CheckpointError
(a damaged or malformed file), ResumeError (a checkpoint of another run:
architecture, settings, or class folders that differ), TrainingDiverged
(a state that is not finite is never written).
"""
import copy
import dataclasses
import functools
import math
import os

import numpy

from .._version import __version__
from .checkpoint import CheckpointError, checkpoint_info, load_checkpoint, save_checkpoint
from ..core.network import NetworkError, network_from_records, network_records
from ..models import is_onnx_path
from ..data.batches import EpochOrder
from ..data.files import DataError
from .rundir import CHECKPOINT, ResumeError
from .config import TrainConfig, lr_at
from ..bits.along import Point

FORMAT = "lowmem-train/1"           # meta["format"] of a training checkpoint
NOT_COMPARED = ("out", "data_dir", "progress", "time_limit", "download")   # may change on resume, silently


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or parameter: the run stopped and no checkpoint was written."""


def zero_sums():
    """The running figures of an epoch (summed over the steps done so far)."""
    return {"loss": 0.0, "correct": 0, "seen": 0, "time": 0.0}


@dataclasses.dataclass
class TrainState:
    """The live objects a step changes, and the counters of the run."""
    net: object                 # lowmem.core.network.Network: parameters, BN statistics
    opt: object                 # lowmem.train.optim.SGD (momentum buffers live on the parameters)
    batches: object             # BatchIterator or ImageLoader: the data order's position
    rng: object                 # numpy Generator of the augmentation
    steps_per_epoch: int
    iteration: int = 0
    sums: dict = dataclasses.field(default_factory=zero_sums)
    last_eval: dict = None


def check_finite(state, why):
    """TrainingDiverged naming the first parameter, statistic or momentum buffer that is not finite."""
    net = state.net
    arrays = [(n, p.data) for n, p in net.params.items()] + list(net.stats.items())
    arrays += [(n + " (momentum)", p.state["momentum"]) for n, p in net.params.items()]
    for name, a in arrays:
        if not (math.isfinite(float(a.min())) and math.isfinite(float(a.max()))):   # NaN propagates
            raise TrainingDiverged(f"non-finite values in {name} after iteration {state.iteration}; {why}")


def save(path, state, config, data_info, epoch_sums=None, world_size=1):
    """Write the checkpoint atomically, after checking every array is finite. world_size: the
    ranks the run trains on (a resume on another number is checked by check_world_size)."""
    check_finite(state, "not saving them")
    net = state.net
    arrays = {f"net/{n}": p.data for n, p in net.params.items()}
    arrays.update({f"net/{n}": a for n, a in net.stats.items()})
    arrays.update({f"momentum/{p.name}": p.state["momentum"] for p in net.parameters()})
    meta = {"format": FORMAT, "lowmem_version": __version__, "config": config.to_dict(), "data": data_info,
            "network": {"name": net.name, "num_params": net.num_params()},
            "iteration": state.iteration, "epoch": state.iteration / state.steps_per_epoch,
            "optimizer": state.opt.state_dict(), "rng": state.rng.bit_generator.state,
            "batches": state.batches.state_dict(), "epoch_sums": epoch_sums or state.sums,
            "last_eval": state.last_eval, "world_size": int(world_size)}
    if is_onnx_path(config.model):            # the file's network, kept: the run never reads the file again
        meta["architecture"] = network_records(net)
    save_checkpoint(path, arrays, meta)


def check_world_size(meta, config, world_size, split_dependent, path, rank_keyed=()):
    """ResumeError when a run saved on one number of ranks cannot continue identically on
    another: the draws of stochastic rounding follow each element's global index and never
    depend on the split, but the unbiased code's groups (256 elements of a unit's per-rank row)
    do when a rank's row is not whole groups. split_dependent(per_rank_batch) -> [unit names].
    rank_keyed: the layers whose draws follow the rank's shard (dropout's masks)."""
    saved = int(meta.get("world_size", 1))
    if saved != world_size and rank_keyed:
        raise ResumeError(f"cannot resume from {path} on {world_size} rank(s): it was saved on {saved}, and "
                          f"dropout layer {rank_keyed[0]}'s masks are drawn per rank's shard, so they would "
                          f"differ; resume on {saved} rank(s)")
    if saved == world_size:
        return
    for ranks in (saved, world_size):
        units = split_dependent(config.batch // ranks)
        if units:
            raise ResumeError(f"cannot resume from {path} on {world_size} rank(s): it was saved on {saved} with "
                              f"rounding={config.rounding!r}, and at the per-rank batch {config.batch // ranks} unit "
                              f"{units[0]}'s rows are not whole groups of 256 elements, so its codes depend on "
                              f"the split; resume on {saved} rank(s)")


def class_difference(saved, now, where="train"):
    """Words for how the class folders changed ("train/a renamed to train/z"), or None if they did not."""
    if list(saved) == list(now):
        return None
    gone, new = [c for c in saved if c not in now], [c for c in now if c not in saved]
    if len(gone) == len(new) == 1:
        return f"{where}/{gone[0]} renamed to {where}/{new[0]}"
    parts = ([f"{where}/{c} is gone" for c in gone] + [f"{where}/{c} is new" for c in new]) or \
        [f"the classes are in another order ({', '.join(now)}; the checkpoint has {', '.join(saved)})"]
    return "; ".join(parts)


def auto_widths(saved_config, config):
    """bits='auto' on resume: the per-unit widths the checkpoint's run chose (its config keeps
    them beside its avg_bits), so the rerun command of an auto run continues it without measuring
    again (check_resumable then compares avg_bits, a FIXED field); None when there are none to
    take (config's bits are not "auto", or the checkpoint's are not a per-unit map)."""
    saved_bits, saved_avg = saved_config.get("bits"), saved_config.get("avg_bits")
    if config.bits == "auto" and isinstance(saved_bits, dict) and saved_avg is not None:
        return dict(saved_bits)
    return None


def _shown(value):
    """A setting as a resume refusal prints it: per-unit widths by their count, not in full."""
    if isinstance(value, dict):
        return f"{len(value)} per-unit widths"
    return repr(value)


def _difference(field, saved, mine):
    """How a FIXED setting differs, in words: two per-unit width maps by their first unit apart."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        apart = [u for u in dict.fromkeys([*saved, *mine]) if saved.get(u) != mine.get(u)]
        more = f", and {len(apart) - 1} more" if len(apart) > 1 else ""
        return (f"{field} (unit {apart[0]!r}: checkpoint {saved.get(apart[0], 'not named')!r}, this run "
                f"{mine.get(apart[0], 'not named')!r}{more})")
    return f"{field} (checkpoint {_shown(saved)}, this run {_shown(mine)})"


def check_resumable(meta, config, data_info, path, log):
    """ResumeError unless `meta` is a training checkpoint of this run: the FIXED settings and the
    class list equal; other changed settings are logged (the continuation then differs)."""
    check_training_meta(meta, path)
    saved, mine = meta["config"], config.to_dict()
    fixed = type(config).FIXED
    diff = [_difference(k, saved.get(k), mine[k]) for k in fixed if saved.get(k) != mine[k]]
    if diff:
        arch = any(saved.get(k) != mine[k] for k in ("model", "depth", "dataset", "pad_to"))
        raise ResumeError(f"cannot resume from {path}: " + ("it holds a different architecture; " if arch else "")
                          + "it differs in " + "; ".join(diff))
    saved_classes = (meta.get("data") or {}).get("classes")       # absent in checkpoints of older versions
    changed = saved_classes is not None and class_difference(saved_classes, data_info["classes"])
    if changed:
        raise ResumeError(f"cannot resume from {path}: the class folders changed since it was saved "
                          f"({changed}); labels are folder positions, so the weights would learn other "
                          f"classes. Restore the folder names, or start a new run")
    changed = [f"{k} {mine[k]!r} (checkpoint {saved.get(k)!r})" for k in mine
               if k not in fixed and k not in NOT_COMPARED and saved.get(k) != mine[k]]
    if changed:
        log("note: resuming with " + ", ".join(changed) + "; the continuation will differ "
            "from an uninterrupted run of the original settings")


def restore(state, arrays, meta, path, xp=numpy):
    """Load parameters, statistics, momentum, optimizer, RNG, data position and counters into `state`."""
    weights = {k[4:]: v for k, v in arrays.items() if k.startswith("net/")}
    try:
        state.net.load_state_dict(weights)
    except ValueError as e:
        raise ResumeError(f"cannot resume from {path}: {e}") from None
    for p in state.net.parameters():
        m = arrays.get(f"momentum/{p.name}")
        if m is None or m.shape != p.shape:
            raise ResumeError(f"cannot resume from {path}: momentum buffer of {p.name} is "
                              f"{'missing' if m is None else m.shape}, expected {p.shape}")
        if m.dtype.kind != "f" or not numpy.isfinite(m).all():
            raise ResumeError(f"cannot resume from {path}: momentum buffer of {p.name} is "
                              + ("not finite" if m.dtype.kind == "f" else f"of dtype {m.dtype}"))
        p.state["momentum"][...] = xp.asarray(m)
    try:
        state.opt.load_state_dict(meta["optimizer"])
        state.rng.bit_generator.state = meta["rng"]
        state.batches.load_state_dict(meta["batches"])
    except DataError as e:
        raise ResumeError(f"cannot resume from {path}: {e}") from None
    except (ValueError, TypeError, KeyError) as e:      # a malformed optimizer, RNG or batch state
        raise CheckpointError(f"checkpoint {path!r}: malformed training metadata "
                              f"({type(e).__name__}: {e})") from None
    state.iteration = int(meta["iteration"])
    if divmod(state.iteration, state.steps_per_epoch) != (state.batches.epoch, state.batches.batch):
        raise ResumeError(f"{path}: iteration {state.iteration} and batch position "
                          f"{state.batches.epoch}:{state.batches.batch} disagree")
    state.sums, state.last_eval = meta["epoch_sums"], meta["last_eval"]


def checkpoint_iteration(path):
    """The iteration a checkpoint holds (its header only), or "?" if it cannot be read."""
    try:
        return checkpoint_info(path)["meta"].get("iteration", "?")
    except CheckpointError:
        return "?"


_META_FIELDS = {"config": dict, "iteration": int, "optimizer": dict, "rng": dict, "batches": dict,
                "epoch_sums": dict}


def check_training_meta(meta, path):
    """Check the metadata of a training checkpoint holds every field resume reads.

    ResumeError when it is not a training checkpoint (format); CheckpointError
    naming each missing or mistyped field otherwise."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: metadata is a {type(meta).__name__}, "
                              f"not a dict")
    if meta.get("format") != FORMAT:
        raise ResumeError(f"{path}: not a lowmem training checkpoint (format {meta.get('format')!r})")
    problems = []
    for key, kind in _META_FIELDS.items():
        if key not in meta:
            problems.append(f"{key!r} is missing")
        elif not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            problems.append(f"{key!r} is a {type(meta[key]).__name__}, expected a {kind.__name__}")
    if isinstance(meta.get("iteration"), int) and meta["iteration"] < 0:
        problems.append(f"'iteration' is {meta['iteration']}, expected >= 0")
    sums = meta.get("epoch_sums")
    if isinstance(sums, dict):
        bad = [k for k in ("loss", "correct", "seen", "time")
               if not isinstance(sums.get(k), (int, float)) or isinstance(sums.get(k), bool)]
        if bad:
            problems.append(f"'epoch_sums' lacks the numbers {bad}")
    if meta.get("last_eval") is not None and not isinstance(meta["last_eval"], dict):
        problems.append(f"'last_eval' is a {type(meta['last_eval']).__name__}, expected a dict or null")
    data = meta.get("data")
    if data is not None and not (isinstance(data, dict) and isinstance(data.get("classes"), list)):
        problems.append("'data' is not a dict with a list of 'classes'")
    if problems:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: malformed training metadata: "
                              + "; ".join(problems))


def saved_config(run_dir):
    """The TrainConfig fields (a dict) stored in run_dir's checkpoint: what --resume starts from.
    ResumeError when there is no checkpoint; CheckpointError when it is damaged or malformed."""
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.exists(path):
        raise ResumeError(f"nothing to resume: {path} does not exist")
    meta = load_checkpoint(path)[1]
    check_training_meta(meta, path)
    return meta["config"]


def kept_network(meta, path, seed=0):
    """The network a checkpoint keeps (meta["architecture"]: a run from an ONNX file), or None.
    CheckpointError when its records are not a network's."""
    if meta.get("architecture") is None:
        return None
    try:
        return network_from_records(meta["architecture"], seed)
    except NetworkError as e:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: {e}") from None


def check_kept_network(net, num_classes, input_shape, path):
    """ResumeError unless the checkpoint's own network fits the data (classes, input channels)."""
    if net.num_classes != num_classes or net.in_channels != input_shape[0]:
        raise ResumeError(f"cannot resume from {path}: its network has {net.num_classes} classes and "
                          f"{net.in_channels} input channels, the data {num_classes} and {input_shape[0]}")


def load_model_state(path, net):
    """Load the parameters and BN statistics of a training checkpoint into `net`.

    Raises CheckpointError for a damaged file and ResumeError (a ValueError)
    naming the mismatch when the checkpoint holds another architecture."""
    arrays, meta = load_checkpoint(path)
    state = {k[4:]: v for k, v in arrays.items() if k.startswith("net/")}
    try:
        net.load_state_dict(state)
    except ValueError as e:
        network = meta.get("network")
        name = network.get("name", "?") if isinstance(network, dict) else "?"
        raise ResumeError(f"{path} holds {name}, not {net.name}: {e}") from None
    return meta


def run_points(net, paths, initial=True):
    """[lowmem.bits.along.Point] from training checkpoints of one run (e.g. the epoch<E>.ckpt
    files an accuracy study keeps), in the order of their iterations: each loaded into its own
    copy of `net` (`net` is not changed), with the iteration and the learning rate its run's
    schedule gives there (both read from the file). initial: `net`'s own weights too, as the point
    at iteration 0 (the run's initial weights when `net` was built as the run built it).
    ResumeError for checkpoints of different runs or of another network."""
    points, first = [], None
    for p in paths:
        held = copy.deepcopy(net)
        meta = load_model_state(p, held)
        check_training_meta(meta, p)
        c, b = TrainConfig(**meta["config"]), meta["batches"]
        total = c.epochs * len(EpochOrder(b["num_samples"], b["batch_size"], drop_last=b.get("drop_last", True)))
        run = {"model": c.model, "depth": c.depth, "seed": c.seed, "lr": c.lr, "schedule": c.schedule,
               "epochs": c.epochs, "iterations": total}
        if first is not None and run != first[1]:
            diff = ", ".join(f"{k} {run[k]} vs {first[1][k]}" for k in run if run[k] != first[1][k])
            raise ResumeError(f"{p} is from another run than {first[0]} ({diff}): price one run's checkpoints")
        first = first or (p, run, c)
        it = int(meta["iteration"])
        points.append(Point(held, it, lr_at(min(it, total - 1), total, c), total,
                            functools.partial(lr_at, total=total, config=c)))
    if initial:
        if not points:
            raise ValueError("initial=True prices the initial weights along a run: name its checkpoints too")
        points.append(Point(net, 0, lr_at(0, points[0].total, first[2]), points[0].total, points[0].schedule))
    return sorted(points, key=lambda q: q.iteration)
