"""The `headsplit` policy's devices over workers: the planner's head placement at start, and a new one without
the workers lost mid-generation. No tensor code here."""

from __future__ import annotations

import logging
from collections.abc import Callable

from edgespec.engine.executor import Executor
from edgespec.model.headsplit import HeadSplitPipeline, MemoryWatch
from edgespec.planning.headsplit import LayerPlace, place, profiled_devices
from edgespec.server.replanner import ClusterManager
from edgespec.server.settings import ServeSettings
from edgespec.workers.head_client import remote_headsplit

log = logging.getLogger(__name__)


class HeadSplitCluster:
    """Places HeadSplit's blocks (head groups, projections, FFNs) over the workers that are up, from the shipped
    HeadSplit profile (`record`: acceptance and block times) and the cluster profile's memory and round trips,
    and re-places them when a worker is lost (`recover`, the HeadSplit engine's re-placement)."""

    def __init__(self, settings: ServeSettings, cluster: ClusterManager, record, card, alphas: list[float], cfg,
                 context: int):
        self.settings, self.cluster, self.record, self.card = settings, cluster, record, card
        self.alphas, self.cfg, self.context = alphas, cfg, context

    def _link(self, a: str, b: str) -> float:  # one message of a token's hidden state, with the margin
        return self.cluster.profile.transfer_ms(a, b, 1)

    def _capacities(self, names) -> dict[str, int]:
        return {n: self.cluster.profile.device(n).memory_capacity_bytes for n in names}

    def _place(self, names, slots: int, fraction: float = 1.0) -> list[LayerPlace]:
        room = {n: int(fraction * c) for n, c in self._capacities(names).items()}
        return place(profiled_devices(self.record, room, self.context), self.card, self.alphas, self._link, slots)

    def pipeline(self, names: list[str] | None = None) -> HeadSplitPipeline:
        """The placement over these workers (default: every worker that is up), assigned to them."""
        names = names or [m.name for m in self.cluster.members.values() if m.up]
        layers = self._place(names, self.context)
        urls = {n: self.cluster.members[n].url for n in names}
        pipe = remote_headsplit(urls, self.cluster.config.token, layers, self.cfg, self.settings.dtype,
                                self.settings.model, self.settings.headsplit_epsilon, self.settings.stage_timeout_s,
                                kv_format=self.settings.kv_format)
        threshold = self.settings.memory_threshold
        replan: Callable[[int], list] = lambda slots: self._place(names, max(slots, 1), threshold)  # noqa: E731
        pipe.watch(MemoryWatch(self._capacities(names), replan, threshold))
        log.info("headsplit placement: %s", "; ".join(
            f"{i}: groups {lp.groups}, proj {lp.proj}, ffn {lp.ffn}{', speculates' if lp.speculate else ''}"
            for i, lp in enumerate(layers)))
        return pipe

    async def recover(self, executor: Executor, error: Exception, generation: int) -> bool:
        """A call to a HeadSplit device failed in work begun under placement `generation`: place every block
        again over the devices that still answer (each assigned afresh, so nothing half written survives) and
        have the executor rebuild its sessions from their tokens. False when no placement fits them."""
        if executor.generation != generation:
            return True
        old = executor.pipeline
        assert isinstance(old, HeadSplitPipeline)
        alive = await self.cluster.answering(sorted(old.devices), self.cluster.probe_s)
        lost = sorted(set(old.devices) - alive)
        log.warning("a HeadSplit device call failed (%s); lost: %s", error, ", ".join(lost) or "none")
        if not alive:
            return False

        def swap() -> None:  # on the model thread, between steps
            new = self.pipeline(sorted(alive))
            new.adopt(old)
            executor.replace(new)
            old.close()

        try:
            await executor.call(swap)
        except Exception as exc:  # no placement fits (planning's InfeasibleError), or a device failed again
            log.error("HeadSplit could not be placed again: %s", exc)
            return False
        return True
