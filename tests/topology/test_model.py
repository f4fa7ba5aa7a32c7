"""topology.py: YAML in, exact error text out (tests/data/topologies is the bad-file corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdctl.dev.tiny_models import CACHE_ENV
from epdctl.errors import PlanError, TopologyError
from epdctl.topology.model import (
    ROLE_NAMES,
    Topology,
    canonical_flag,
    flag_value,
    load_topology,
    parse_duration,
    parse_size,
    parse_topology,
    require_local_model,
)

ROOT = Path(__file__).parents[2]
CORPUS = Path(__file__).parents[1] / "data" / "topologies"
SHIPPED = sorted((ROOT / "topologies").glob("*.yaml"))
MINIMAL = {"name": "demo", "model": "Qwen/Qwen2.5-VL-3B-Instruct", "roles": {"prefill_decode": {}}}

# Every file of the corpus and the exact lines under "<path>: invalid topology".
EXPECTED = {
    "alias-bomb.yaml": [
        'the file expands to more than 100000 values (YAML aliases?)',
    ],
    "bad-name.yaml": [
        ('name: expected lower-case letters, digits and dashes (at most 42, starting and ending '
         "with a letter or digit), got 'My Qwen Topology'"
         ),
        'model: must not be empty',
        'served_model_name: expected a string, got 42',
        "device: expected 'cuda' or 'cpu', got 'tpu'",
    ],
    "comments-only.yaml": [
        'the file is empty',
    ],
    "cpu-with-gpus.yaml": [
        'roles -> encode -> gpus: a `device: cpu` topology takes no GPUs',
        'roles -> prefill_decode -> tensor_parallel: must be 1 on `device: cpu`',
    ],
    "decode-without-prefill.yaml": [
        'roles: decode needs a prefill role (E|P|D)',
    ],
    "duplicate-key.yaml": [
        'line 8, column 3: duplicate key `encode` (first on line 4)',
    ],
    "empty.yaml": [
        'the file is empty',
    ],
    "encode-alone.yaml": [
        'roles: encode alone serves nothing; add prefill_decode, or prefill and decode',
    ],
    "encoder-flags-differ.yaml": [
        ("roles -> prefill_decode -> args: --dtype differs from the encode role's (encoder "
         'outputs would not fit); put it in engine.args instead'
         ),
    ],
    "gpu-count-mismatch.yaml": [
        'roles -> encode -> gpus: 2 replicas x tensor_parallel 1 need 2 GPUs, 3 asked for',
        'roles -> prefill_decode -> gpus: 2 replicas x tensor_parallel 2 need 4 GPUs, 3 given',
    ],
    "gpu-listed-twice.yaml": [
        'roles -> encode -> gpus: GPU 0 is listed twice',
    ],
    "gpus-negative.yaml": [
        'roles -> encode -> gpus: expected a list of GPU indices or a count, got -1',
        'roles -> prefill_decode -> gpus: expected a list of GPU indices or a count, got -2',
    ],
    "gpus-not-indices.yaml": [
        "roles -> encode -> gpus: expected a list of GPU indices or a count, got 'a'",
        "roles -> prefill_decode -> gpus: expected a list of GPU indices or a count, got '1,2'",
    ],
    "list.yaml": [
        'expected a mapping (name:, model:, roles:, ...), got a list',
    ],
    "missing-required.yaml": [
        'name: required key is missing',
        'model: required key is missing',
        'roles: required key is missing',
    ],
    "no-roles.yaml": [
        'roles: at least one role is needed: prefill_decode, or prefill and decode',
    ],
    "not-utf8.yaml": [
        'not UTF-8 text (byte 0xe9 at offset 21)',
    ],
    "overlap-encode-timeout.yaml": [
        ("proxy -> encode_timeout: 120s must be below proxy.decode_timeout (90s) with overlap "
         "on: P or PD waits for E that long before it encodes the item itself"),
    ],
    "pd-with-p-and-d.yaml": [
        ('roles: prefill_decode cannot be combined with prefill or decode; use encode + '
         'prefill_decode (E|PD) or encode + prefill + decode (E|P|D)'
         ),
    ],
    "ports-out-of-range.yaml": [
        'proxy -> port: expected a port number from 1 to 65535, got 70000',
        'ports -> base: expected a port number from 1 to 65535, got 0',
        "ports -> side_channel_base: expected an integer, got '5600'",
    ],
    "prefill-without-decode.yaml": [
        'roles: prefill needs a decode role (E|P|D)',
    ],
    "python-tag.yaml": [
        ('line 2, column 8: not valid YAML: could not determine a constructor for the tag '
         "'tag:yaml.org,2002:python/object/apply:os.system'"
         ),
    ],
    "reserved-flags.yaml": [
        'engine -> args: --port is set by epdctl (see `ports.base`)',
        'engine -> args: --served-model-name is set by epdctl; use `served_model_name`',
        ("roles -> encode -> args: --gpu-memory-utilization is set by epdctl; use the role's "
         '`gpu_memory_utilization`'
         ),
        'roles -> prefill_decode -> gpus: 1 replica x tensor_parallel 1 needs 1 GPU, 2 given',
        ('roles -> prefill_decode -> args: --tensor-parallel-size is set by epdctl; use the '
         "role's `tensor_parallel`"
         ),
        'roles -> prefill_decode -> args: --kv-transfer-config is set by epdctl (see `kv`)',
    ],
    "scalar.yaml": [
        "expected a mapping (name:, model:, roles:, ...), got a single value ('just some text')",
    ],
    "sections-not-mappings.yaml": [
        'engine: expected a mapping, got ["vllm", "serve"]',
        "cache: expected a mapping, got '/dev/shm/epdctl'",
        'roles: expected a mapping, got ["encode", "prefill_decode"]',
    ],
    "tp-larger-than-gpus.yaml": [
        'roles -> prefill_decode -> gpus: 1 replica x tensor_parallel 4 needs 4 GPUs, 2 given',
    ],
    "unknown-keys.yaml": [
        'modle: unknown key (did you mean `model`?)',
        'proxy -> prot: unknown key (did you mean `port`?)',
        'roles -> encode -> gpu: unknown key (did you mean `gpus`?)',
        ('roles -> prefill_decode -> tensor_parallelism: unknown key (did you mean '
         '`tensor_parallel`?)'
         ),
        'model: required key is missing',
    ],
    "unknown-role.yaml": [
        ('roles -> encoder: unknown role (did you mean `encode`?); roles are encode, '
         'prefill_decode, prefill and decode'
         ),
        'roles -> vision: unknown role; roles are encode, prefill_decode, prefill and decode',
    ],
    "wrong-types.yaml": [
        "engine -> args: expected a list, got '--max-model-len 8192'",
        'engine -> env -> HF_HOME: expected a string, got ["/data/hf"]',
        "cache -> capacity: expected a size such as 8GiB or 512MiB, got 'lots'",
        "cache -> ttl: expected a duration such as 30s, 10m or 2h, got 'soon'",
        "cache -> keep_on_down: expected true or false, got 'maybe'",
        'proxy -> max_inflight: must be at least 1, got 0',
        'proxy -> encode_timeout: must be more than 0, got -5',
        "roles -> encode -> replicas: expected an integer, got 'two'",
        'roles -> encode -> tensor_parallel: expected an integer, got 1.5',
        ('roles -> prefill_decode -> gpu_memory_utilization: expected a fraction of GPU memory '
         'above 0 and at most 1, got 1.5'
         ),
        "restart -> policy: expected 'no' or 'on-failure', got 'always'",
        'restart -> max_restarts: must be at least 0, got -1',
    ],
    "yaml-bad-indent.yaml": [
        ("line 6, column 4: not valid YAML: expected <block end>, but found '<block mapping "
         "start>' (check the indentation)"
         ),
    ],
    "yaml-tab.yaml": [
        ("line 4, column 1: not valid YAML: found character '\\t' that cannot start any token "
         '(indent with spaces, not tabs)'
         ),
    ],
    "yaml-unclosed-flow.yaml": [
        "line 5, column 3: not valid YAML: expected ',' or '}', but got '<scalar>'",
    ],
}


def _message(path: Path, lines: list[str]) -> str:
    body = "\n".join(f"  {line.replace('{dir}', str(path.parent))}" for line in lines)
    return f"{path}: invalid topology\n{body}"


def test_the_corpus_is_complete() -> None:
    assert sorted(p.name for p in CORPUS.iterdir()) == sorted(EXPECTED)
    assert len(EXPECTED) >= 20


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_file_gives_exact_message(name: str) -> None:
    path = CORPUS / name
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value) == _message(path, EXPECTED[name])
    assert info.value.exit_code == 1


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_topologies_load(path: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # a fresh machine: no tiny model built yet
    topology = load_topology(path)
    assert topology.device == "cuda" or path.name.startswith("cpu-")
    assert path.read_text().startswith("#"), "each shipped topology starts with a comment header"


def test_huge_file(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("name: demo\n" + "#" * (1 << 20))
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value) == (
        f"{path}: invalid topology\n"
        f"  the file is {(1 << 20) + 11} bytes; a topology file is at most 1 MiB"
    )


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"^.*/nope\.yaml: no such file$"):
        load_topology(tmp_path / "nope.yaml")
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a topology file"


def test_defaults_and_empty_sections() -> None:
    topology = parse_topology({**MINIMAL, "cache": None, "roles": {"encode": None,
                                                                   "prefill_decode": None}})
    assert topology.device == "cuda"
    assert topology.cache.capacity == 8 << 30
    assert topology.proxy.port == 8000
    assert topology.roles["encode"].replicas == 1
    assert topology.roles["encode"].gpus is None
    assert topology.mode == "e-pd"
    assert topology.model_name == "Qwen/Qwen2.5-VL-3B-Instruct"


@pytest.mark.parametrize(("roles", "mode"), [
    ({"encode": {}, "prefill_decode": {}}, "e-pd"),
    ({"encode": {}, "prefill": {}, "decode": {}}, "epd"),
    ({"prefill": {}, "decode": {}}, "p-d"),
    ({"prefill_decode": {}}, "pd"),
])
def test_mode(roles: dict, mode: str) -> None:
    assert parse_topology({**MINIMAL, "roles": roles}).mode == mode


def test_yaml_conveniences(tmp_path: Path) -> None:
    # `policy: no` is YAML's false; numbers in args and env lists become text.
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: demo\nmodel: m\nrestart: {policy: no}\n"
        "engine: {args: [--max-model-len, 8192, --gpu-block-size, 0.5], env: {OMP: 4}}\n"
        "roles: {prefill_decode: {gpus: 1}}\n"
        "cache: {dir: store, capacity: 512MiB, ttl: 1.5h}\n"
    )
    topology = load_topology(path)
    assert topology.restart.policy == "no"
    assert topology.engine.args == ["--max-model-len", "8192", "--gpu-block-size", "0.5"]
    assert topology.engine.env == {"OMP": "4"}
    assert topology.cache.dir == tmp_path / "store"
    assert topology.cache.capacity == 512 << 20
    assert topology.cache.ttl == 5400.0


def test_local_model_path_becomes_absolute(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    path = tmp_path / "t.yaml"
    path.write_text("name: demo\nmodel: ./models/tiny\nroles: {prefill_decode: {}}\n")
    assert load_topology(path).model == str(tmp_path / "models" / "tiny")


def test_a_missing_local_model_loads_but_up_requires_it(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("name: demo\nmodel: ./models/none\nroles: {prefill_decode: {}}\n")
    topology = load_topology(path)  # render and --dry-run need no model here
    assert topology.model == str(tmp_path / "models" / "none")
    with pytest.raises(PlanError) as info:
        require_local_model(topology)
    assert str(info.value) == (f"`demo`: model path {tmp_path}/models/none does not exist; "
                               "put the model there, or name a Hugging Face id")
    assert info.value.exit_code == 1
    (tmp_path / "models" / "none").mkdir(parents=True)
    require_local_model(topology)
    require_local_model(parse_topology(MINIMAL))  # a hub id is never checked here


@pytest.mark.parametrize(("model", "command"), [
    ("{cache}/qwen2vl", "python -m epdctl.dev.tiny_models qwen2vl"),
    ("{home}/.cache/epdctl/tiny-models/llava",
     "python -m epdctl.dev.tiny_models llava --link {home}/.cache/epdctl/tiny-models/llava"),
])
def test_a_missing_tiny_model_names_the_command_that_builds_it(
    tmp_path: Path, monkeypatch, model: str, command: str
) -> None:
    home, cache = tmp_path / "home", tmp_path / "tiny"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(CACHE_ENV, str(cache))
    model = model.format(home=home, cache=cache)
    topology = parse_topology({**MINIMAL, "model": model})
    with pytest.raises(PlanError) as info:
        require_local_model(topology)
    assert str(info.value) == (f"`demo`: model path {model} does not exist; "
                               f"build it with `{command.format(home=home)}`")


def test_served_model_name() -> None:
    assert parse_topology({**MINIMAL, "served_model_name": "qwen"}).model_name == "qwen"


@pytest.mark.parametrize(("host", "ok"), [
    ("127.0.0.1", True), ("0.0.0.0", True), ("::", True), ("localhost", True),
    ("http://localhost", False), ("localhost:8000", False), ("", False),
])
def test_proxy_host(host: str, ok: bool) -> None:
    data = {**MINIMAL, "proxy": {"host": host}}
    if ok:
        assert parse_topology(data).proxy.host == host
    else:
        with pytest.raises(TopologyError) as info:
            parse_topology(data, "t.yaml")
        assert str(info.value) == (
            "t.yaml: invalid topology\n  proxy -> host: expected an address such as 127.0.0.1 "
            f"or 0.0.0.0 (no scheme or port), got {host!r}"
        )


E_PD = {"encode": {}, "prefill_decode": {}}
E_P_D = {"encode": {}, "prefill": {}, "decode": {}}


@pytest.mark.parametrize(("roles", "proxy", "refused"), [
    (E_PD, {"overlap": True, "encode_timeout": 120}, "decode_timeout (120s)"),
    (E_PD, {"overlap": True, "encode_timeout": 119.5}, None),
    (E_P_D, {"overlap": True, "encode_timeout": 30, "prefill_timeout": 30,
             "decode_timeout": 300}, "prefill_timeout (30s)"),
    (E_P_D, {"overlap": True, "encode_timeout": 30, "prefill_timeout": 31,
             "decode_timeout": 10}, None),
    (E_PD, {"encode_timeout": 600}, None),  # without overlap PD starts after E gave up
    ({"prefill_decode": {}}, {"overlap": True, "encode_timeout": 600}, None),  # no E
])
def test_with_overlap_encode_timeout_must_be_below_the_waiting_stages(
        roles: dict, proxy: dict, refused: str | None) -> None:
    """With overlap P (E|P|D) or PD (E|PD) gets the request beside E's and waits for E up to
    encode_timeout: its own timeout must be longer, or a hung E turns into a 504."""
    data = {**MINIMAL, "roles": roles, "proxy": proxy}
    if refused is None:
        parse_topology(data)
        return
    with pytest.raises(TopologyError) as info:
        parse_topology(data, "t.yaml")
    (line,) = str(info.value).splitlines()[1:]
    assert line.startswith(f"  proxy -> encode_timeout: {proxy['encode_timeout']}s must be "
                           f"below proxy.{refused} with overlap on")


def test_short_tp_flag_is_reserved() -> None:
    data = {**MINIMAL, "roles": {"prefill_decode": {"args": ["-tp", "2"]}}}
    with pytest.raises(TopologyError, match="-tp is set by epdctl; use the role's"):
        parse_topology(data)


def test_namespace_flags_may_be_spelled_differently() -> None:
    # Same JSON with other spacing and the --flag=value form: E and PD still agree.
    roles = {
        "encode": {"args": ['--mm-processor-kwargs={"max_pixels": 1003520}', "--dtype", "half"]},
        "prefill_decode": {"args": ["--mm_processor_kwargs", '{"max_pixels":1003520}',
                                    "--dtype=half"]},
    }
    assert parse_topology({**MINIMAL, "roles": roles}).roles["encode"].args


def test_flag_value() -> None:
    args = ["--dtype", "half", "--x", "--dtype=bfloat16", "--max_model_len", "9", "--last"]
    assert flag_value(args, "--dtype") == "bfloat16"
    assert flag_value(args, "--max-model-len") == "9"
    assert flag_value(args, "--last") is None
    assert flag_value(args, "--missing") is None
    assert canonical_flag(['--k={"b": 1, "a": 2}'], "--k") == '{"a":2,"b":1}'
    assert canonical_flag(["--k", "{not json"], "--k") == "{not json"


@pytest.mark.parametrize(("text", "size"), [
    ("8GiB", 8 << 30), ("512M", 512_000_000), ("1.5kib", 1536), (1000, 1000), ("64 MiB", 64 << 20),
])
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["lots", True, 1.5, "8XB", "-1GiB"])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a size such as 8GiB or 512MiB"):
        parse_size(bad)


@pytest.mark.parametrize(("text", "seconds"), [
    ("30m", 1800.0), ("90s", 90.0), ("1.5h", 5400.0), (45, 45.0), ("250ms", 0.25), ("1d", 86400.0),
])
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_role_names_are_the_schema_keys() -> None:
    assert set(ROLE_NAMES) == {"encode", "prefill_decode", "prefill", "decode"}
    assert Topology.model_fields["roles"].description  # the field docstrings are the schema docs


def test_bad_topology_through_the_cli_launches_nothing(epdctl, state_root: Path) -> None:
    path = CORPUS / "pd-with-p-and-d.yaml"
    result = epdctl("up", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"Error: {_message(path, EXPECTED[path.name])}\n"
    assert list(state_root.iterdir()) == []


def test_encoder_flags_compare_what_each_instance_really_gets() -> None:
    # engine.args reach every instance; a role that overrides --dtype splits E from PD.
    data = {**MINIMAL, "engine": {"args": ["--dtype", "bfloat16"]},
            "roles": {"encode": {}, "prefill_decode": {"args": ["--dtype", "float16"]}}}
    with pytest.raises(TopologyError) as info:
        parse_topology(data, "t.yaml")
    assert str(info.value) == (
        "t.yaml: invalid topology\n  roles -> prefill_decode -> args: --dtype differs from the "
        "encode role's (encoder outputs would not fit); put it in engine.args instead"
    )
