"""What vLLM's processes import: the connector module and the general plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_importing_the_connector_loads_no_cli_libraries_and_touches_nothing() -> None:
    code = (
        "import sys\n"
        "touched = []\n"
        "def hook(event, args):\n"
        "    path = str(args[0]) if args else ''\n"
        "    if event in ('open', 'os.mkdir', 'os.link') and path.startswith('/dev/shm'):\n"
        "        touched.append(path)\n"
        "sys.addaudithook(hook)\n"
        "import epdctl.connector, epdctl.connector.plugin\n"
        "epdctl.connector.EpdctlShmECConnector\n"
        "import torch\n"
        "bad = {'click', 'rich', 'httpx', 'epdctl.topology', 'epdctl.cli'} & set(sys.modules)\n"
        "print(sorted(bad), torch.cuda.is_initialized(), 'vllm' in sys.modules, touched)\n"
    )
    assert run(code) == "[] False True []"


def test_the_tensor_io_works_without_vllm() -> None:
    code = (
        "import sys\n"
        "from epdctl.connector import _io\n"
        "print('vllm' in sys.modules)\n"
    )
    assert run(code) == "False"  # the class loads lazily: GPU benchmarks need only torch


def test_register_is_idempotent_and_resolves_the_class() -> None:
    code = (
        "from epdctl.connector.plugin import register\n"
        "register(); register()\n"
        "from vllm.config import ECTransferConfig\n"
        "from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory\n"
        "cfg = ECTransferConfig(ec_connector='EpdctlShmECConnector', ec_role='ec_consumer')\n"
        "print(ECConnectorFactory.get_connector_class(cfg).__qualname__)\n"
    )
    assert run(code) == "EpdctlShmECConnector"


def test_the_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "epdctl_ec"]
    assert ep.value == "epdctl.connector.plugin:register"
