"""An out-of-tree EC connector for the tests (`cache.connector:
tests.ec_recording:RecordingECConnector`): vLLM's ECExampleConnector that writes each
start, save and load to the file named by `record_path` in its extra config.

Lines: `<engine_id> <role> init` per connector object (scheduler and worker sides),
`<engine_id> save <mm_hash>` on E, `<engine_id> load <mm_hash>` on P/PD.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.example_connector import (
    ECExampleConnector,
    ECExampleConnectorMetadata,
)


class RecordingECConnector(ECExampleConnector):
    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config, role)
        config = vllm_config.ec_transfer_config
        self._record_path = config.get_from_extra_config("record_path", None)
        self._engine_id = config.engine_id
        self._write(f"{role.name.lower()} init")

    def _write(self, line: str) -> None:
        if self._record_path:
            # One short O_APPEND write per line: lines from several processes never mix.
            with open(self._record_path, "a") as f:
                f.write(f"{self._engine_id} {line}\n")

    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        super().save_caches(encoder_cache, mm_hash, **kwargs)
        if self.is_producer:
            self._write(f"save {mm_hash}")

    def start_load_caches(self, encoder_cache: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        wanted = [m.mm_hash for m in metadata.mm_datas if m.mm_hash not in encoder_cache] \
            if isinstance(metadata, ECExampleConnectorMetadata) else []
        super().start_load_caches(encoder_cache, **kwargs)
        for mm_hash in wanted:
            if mm_hash in encoder_cache:
                self._write(f"load {mm_hash}")
