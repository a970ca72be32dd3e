"""Output safety of CUDA-graph replays: handing out outputs without a clone.

A tensor returned by one call must never be overwritten by the next, the classic failure of
CUDA-graph runtimes. Cloning every output is safe but costs ~12 us of CPU
per call on an H100 host, as much as the rest of a small model's call. So the graph is captured
up to HANDOUT_SLOTS more times, each copy ending with a copy of its outputs into buffers of its
own, and a call hands out the buffers of a copy whose previous outputs nobody holds any more
(the storage's use count, which views also raise, is back to fxfuse's own references). Only
when the caller still holds all of them does the call replay the first graph and clone.

Where the first graph's pool is small (OWN_POOL_MAX_BYTES), each copy gets a memory pool of
its own and its outputs are handed out as they are: no other graph allocates from that pool,
so nothing writes those blocks but the copy's own replay, which only runs while they are free.
This saves the copy kernel at the end of every replay (1.2 us of GPU time per call at batch 1 /
hidden 128 on the H100). A copy whose output is not memory of its own pool (the model returns
an input or a weight as it is) falls back to the shared pool:
the copies then share the first graph's pool for their intermediates (dead between calls, and
the graphs never run concurrently) and end by copying their outputs into buffers allocated
outside the pool before capture. Handing out blocks of a *shared* pool is what must not
happen: such a block can be one that another graph uses for an intermediate (free as far as
the allocator knows, written at every replay of that graph). An earlier version did that and
failed exactly so on the H100.
"""
import collections
import sys
import time

import torch

from .graph_launch import GraphLauncher
from .library_choice import warm_up_gpu
from .log import logger


HANDOUT_SLOTS = 4   # graph copies whose outputs are returned without a clone (runtime._slot_for:
# a copy per recurring input address, so a loop over a few input buffers re-points no memcpy node)
AFFINITY_MAX_GPU_US = 16.0   # graphs of less GPU time settle inputs on copies by address. Launching
# copies in turn cost 1.9-3.3 us of GPU per call at hidden 1024 (graphs of 16.5-17.3 us) and <= 0.4 us up
# to hidden 512 (host_ab_20261123.txt); whether the saved update (host time) outweighs that depends on the
# host: on the H100 machine's fast host 1x1024 ran 17.7 us without and 19.2 with, on a slow one 23.4 and 19.6
DIRECT_MIN_GPU_US = 100.0   # a graph of at least this much GPU time hides its launches when run directly;
DIRECT_MARGIN = 0.8          # and direct runs must be this much faster than replays to be chosen (timing noise)
OWN_POOL_MAX_BYTES = 8 << 20    # first graph's pool up to this: each copy gets a pool of its own
# (small models, where the saved copy is a visible part of a call; at most 4 x 8 MiB more memory
# per specialization; a pool with a tensor over 1 MiB has 20 MiB segments and keeps the copy)


def own_pool_fits(pool) -> bool:
    """Whether the graph copies of a specialization whose first graph has this pool get pools of
    their own (the allocator says which segments are the pool's, and they are small)."""
    segments = pool_segments(pool)
    return segments is not None and sum(size for _, size in segments) <= OWN_POOL_MAX_BYTES


def pool_segments(pool) -> list | None:
    """[(address, size)] of the caching allocator's segments in a graph's memory pool, or None
    where the allocator's snapshot does not say which pool a segment belongs to."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001 -- unknown: the caller copies outputs out instead
        return None
    found = []
    for seg in segments:
        if "segment_pool_id" not in seg:
            return None
        if tuple(seg["segment_pool_id"]) == tuple(pool):
            found.append((seg["address"], seg["total_size"]))
    return found


def inside(segments: list, tensors) -> bool:
    """Whether every tensor's storage lies in one of the segments (empty ones have no bytes to
    overwrite and may have no address)."""
    for t in tensors:
        if t.untyped_storage().nbytes() == 0:
            continue
        start = t.untyped_storage().data_ptr()
        end = start + t.untyped_storage().nbytes()
        if not any(a <= start and end <= a + size for a, size in segments):
            return False
    return True


def is_size(x) -> bool:
    """torch.Size stays a leaf: pytree would flatten it and rebuild a plain tuple."""
    return isinstance(x, torch.Size)


def map_tensors(fn, out):
    """out with fn applied to each tensor, containers (and torch.Size values) as they were."""
    return torch.utils._pytree.tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, out, is_leaf=is_size)


def copies_keeping_aliases(out, fill: bool):
    """out with each tensor copied (fill) or made like it (uninitialized); outputs sharing a storage
    (`return y, y.view(-1)`) as views of one new storage, as eager returns them: cloned one by one,
    an in-place write into one no longer showed in the other (review38)."""
    groups = collections.defaultdict(list)
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and _plain_view(t):
            groups[t.untyped_storage()._cdata].append(t)
    shared = {key for key, ts in groups.items()   # not small views of a big storage (review38c)
              if len(ts) > 1 and ts[0].untyped_storage().nbytes() <= 2 * sum(t.numel() * t.element_size() for t in ts)}
    if not shared:
        return map_tensors(torch.Tensor.clone if fill else torch.empty_like, out)
    storages = {}

    def copy(t):
        key = t.untyped_storage()._cdata
        if key not in shared or not _plain_view(t):
            return t.clone() if fill else torch.empty_like(t)
        if key not in storages:
            storages[key] = t.untyped_storage().clone() if fill else torch.empty(
                t.untyped_storage().nbytes(), dtype=torch.uint8, device=t.device).untyped_storage()
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storages[key], t.storage_offset(), t.shape,
                                                                  t.stride())
    return map_tensors(copy, out)


def fresh_constants(out, storages: set, address):
    """out with each tensor in one of `storages` (the graph's constants: `return torch.zeros(3)`
    folded into an attribute) copied, as eager makes them afresh each call: the same tensor twice
    stays one tensor, and views of one constant (`c, c[1:]`, an expanded default mask of stride
    0) are views of one new storage with eager's strides (fuzz40b: cloned one by one, they came
    back unrelated and row-major)."""
    new, copies = {}, {}

    def small_view(t) -> bool:
        return t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() + 4096

    constants = [t for t in torch.utils._pytree.tree_leaves(out, is_leaf=is_size)
                 if isinstance(t, torch.Tensor) and address(t) in storages]
    keys = collections.Counter(t.untyped_storage()._cdata for t in {id(t): t for t in constants}.values())
    whole = {t.untyped_storage()._cdata for t in constants   # a storage copied whole where an output covers
             if not small_view(t) or keys[t.untyped_storage()._cdata] > 1}   # it, or several views share it
    #                                                           (`c[:16], c[8:24]`: review44h)

    def copy(t):
        if address(t) not in storages:
            return t
        if id(t) not in new:
            key = t.untyped_storage()._cdata
            if t.is_conj() or t.is_neg() or t.numel() == 0 or small_view(t) and key not in whole:
                new[id(t)] = t.clone()   # a small view of a big constant: its own copy (unless the storage
                #                          is copied for another output anyway: `c, c[:16]`, fuzz44c)
            else:
                if key not in copies:
                    copies[key] = t.untyped_storage().clone()
                new[id(t)] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    copies[key], t.storage_offset(), t.shape, t.stride())
        return new[id(t)]
    return map_tensors(copy, out)


def _plain_view(t: torch.Tensor) -> bool:
    """A view set_ can rebuild: no conj/neg bit, not empty, no overlapping strides (2: too hard to
    tell, a strided view such as a diagonal, is fine; review38c, review38d)."""
    return not (t.is_conj() or t.is_neg()) and t.numel() > 0 and torch._debug_has_internal_overlap(t) != 1


class OutputSlots:
    """A graph copy and the buffers its outputs are copied into, handed to the caller without
    a copy of their own.

    Free when no tensor outside fxfuse shares their storages: torch's use count of each
    storage is back to what it was right after capture (our own references). A returned
    tensor, a view of it, or a tensor made from its storage all raise the count.
    """

    def __init__(self, launcher, buffers, inputs):
        self.launcher, self.inputs = launcher, inputs
        self.key = None   # the address its first memcpy node reads (runtime's slot_at index)
        self.settled = -1   # the call that last indexed it there
        self.leaves, self.tree = torch.utils._pytree.tree_flatten(buffers, is_leaf=is_size)
        self.single = self.tree.is_leaf() and isinstance(buffers, torch.Tensor)   # the usual case: one tensor
        tensors = [t for t in self.leaves if isinstance(t, torch.Tensor)]
        storages = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}.values())
        self._storages = storages   # kept alive: the counts below are of these storages
        # tensors over a storage raise its use count; a caller keeping only y.untyped_storage()
        # does not, but holds the one Python object torch keeps for it: its reference count
        self._counts = [(s, s._cdata, torch._C._storage_Use_Count(s._cdata), sys.getrefcount(s)) for s in storages]

    def free(self) -> bool:
        for storage, cdata, uses, refs in self._counts:
            if torch._C._storage_Use_Count(cdata) > uses or sys.getrefcount(storage) > refs:
                return False
        return True

    def hand_out(self):
        """The outputs as new tensors over the buffers (their use counts mark them held)."""
        if self.single:
            return self.leaves[0].detach()
        leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in self.leaves]
        return torch.utils._pytree.tree_unflatten(leaves, self.tree)


class SlotChoice:
    """The part of specialization.Specialization that picks the graph copy (OutputSlots) for a call.

    It uses the specialization's graph, inputs, handout, slot_at, draws_random, device_index
    and _capture_slot()."""

    def _choose_affinity(self) -> None:
        """Whether calls settle on graph copies by input address (_slot_for). It saves the node
        update, host time, but launching different graph copies in turn costs GPU time (2-3 us
        per call at hidden 1024 on the H100, nothing at 128: host_ab_20261123.txt), so only
        for a graph of little GPU time (timed here once), where the host is the likely bound."""
        bound = self.inputs.exec is not None
        self.affinity, self.replay_us = bound, None
        if self.draws_random:   # a replay would move the generator (timed also without memcpy nodes: _choose_direct)
            return
        try:
            warm_up_gpu()   # an idle GPU's clocks (345 MHz on the H100) would time the graph slow
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.graph.replay()
            times = []
            for _ in range(3):
                start.record()
                for _ in range(5):
                    self.graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 200)
        except RuntimeError as e:
            logger.info("timing the graph failed, no address affinity: %s", e)
            self.affinity = False
            return
        self.replay_us = min(times)
        self.affinity = bound and self.replay_us < AFFINITY_MAX_GPU_US

    def _choose_direct(self, args) -> None:
        """Whether calls run the graph directly, without the CUDA graph: where the graph's GPU time hides
        every launch (>= DIRECT_MIN_GPU_US) the replay only adds copies, of large inputs into the graph's
        buffers and of its outputs out of a shared pool (review48: a GELU over 1 GiB took 1787 us replayed
        against 1014 in eager). Both ways are timed here, through the paths a call takes; the direct one
        must win clearly (DIRECT_MARGIN), and its graph copies and buffers are freed."""
        if self.replay_us is None or self.replay_us < DIRECT_MIN_GPU_US:
            return
        def per_call(run):
            run(args)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                run(args)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / 3 * 1e6
        try:
            replayed = min(per_call(self._replay) for _ in range(2))
            self._set_pdl(False)   # (the generated GEMMs' dependent launch: inside a CUDA graph only)
            direct = min(per_call(self._run_directly) for _ in range(2))
        except RuntimeError as e:
            logger.info("timing the direct run failed, keeping the CUDA graph: %s", e)
            direct = replayed = float("inf")
        finally:
            self.handed_out = self.cloned = 0   # the timing's calls are no calls of the user's
        if not direct < DIRECT_MARGIN * replayed:
            self._set_pdl(True)    # later graph copies capture the kernels again
        else:
            self.graph, self.handout, self.launcher, self.inputs = None, None, None, None   # frees the graphs
            self.static_in, self.bound_in, self.static_out, self.slot_at = [], [], None, {}
            self.cuda_graph_note = (f"off: running the graph directly measured faster ({direct:.0f} us per call "
                                    f"against {replayed:.0f} replayed: the replay copies large inputs or outputs)")

    def affinity_note(self) -> str:
        if self.handout is None or self.inputs.exec is None:
            return ""
        if self.replay_us is None:
            return "; graph copies by input address (graph not timed: it draws random numbers)"
        side = "<" if self.affinity else ">="
        return (f"; {'' if self.affinity else 'no '}graph copies by input address (graph {self.replay_us:.1f} us "
                f"of GPU time {side} {AFFINITY_MAX_GPU_US:g})")

    def _slot_for(self, tensors):
        """(slot, settled): a handout slot whose outputs nobody holds (or None), and whether it
        was found by address. With affinity, preferably the slot whose first memcpy node already
        reads the first bound tensor, so the load re-points nothing (other inputs it re-points
        as needed, and it is correct in every case). That saves the node update (2.6 us of host
        time on the H100 host, as much as the launch): a loop's inputs usually come back to a
        few addresses (the caching allocator hands a freed block to the next input), so each
        settles on a graph copy of its own, and a new copy is captured (up to HANDOUT_SLOTS)
        while every free one reads elsewhere."""
        if self.affinity:
            slot = self.slot_at.get(tensors[self.inputs.bound[0][0]].data_ptr())
            if slot is not None and slot.free():
                return slot, True
        return self._free_slot(), False

    def _free_slot(self):
        """A free slot (with affinity the least recently settled one, so that a loop moving to
        new input buffers settles again), or a new one while every free one reads elsewhere
        (affinity) or none is free; None when all HANDOUT_SLOTS are held."""
        spare = None
        for slot in self.handout:
            if slot.free() and (spare is None or slot.settled < spare.settled):
                spare = slot     # the least recently settled: a new set of addresses settles too
                if not self.affinity:
                    break
        if len(self.handout) >= HANDOUT_SLOTS or (spare is not None and not self.affinity):
            return spare
        try:
            graph, buffers, inputs = self._capture_slot()
            slot = OutputSlots(GraphLauncher(graph, self.device_index, self.draws_random), buffers, inputs)
        except Exception as e:  # noqa: BLE001 -- an optimization: keep cloning from the first graph
            torch.cuda.synchronize()
            self.handout = None
            self.handout_note = f"outputs cloned: capturing a graph copy failed ({type(e).__name__}: {str(e)[:200]})"
            logger.info("handout capture failed, cloning outputs: %s", e)
            return None
        self.handout.append(slot)
        return slot

    def _settle(self, slot, tensors) -> None:
        """Index the slot by the address its first memcpy node now reads."""
        key = tensors[self.inputs.bound[0][0]].data_ptr()
        if self.slot_at.get(slot.key) is slot:
            del self.slot_at[slot.key]
        slot.key, self.slot_at[key] = key, slot
        slot.settled = self.calls
