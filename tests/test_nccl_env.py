"""The trainer turns on NCCL's async error handling and flight recorder, dumps in the run dir."""

import os

from hybridpar.train.nccl_env import TRACE_DIR, nccl_env

KEYS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE")


def test_a_run_records_nccl_traffic_and_dumps_it_into_its_directory_on_timeout(
        tmp_path, monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    values = nccl_env(tmp_path, create=True)
    assert values == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                      "TORCH_FR_BUFFER_SIZE": "2000",
                      "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                      "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / TRACE_DIR / "rank_")}
    assert all(os.environ[k] == v for k, v in values.items())
    assert (tmp_path / TRACE_DIR).is_dir()


def test_a_value_the_user_set_wins_and_a_cpu_run_makes_no_folder(tmp_path, monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    values = nccl_env(tmp_path, create=False)
    assert values["TORCH_FR_BUFFER_SIZE"] == "100"
    assert not (tmp_path / TRACE_DIR).exists()
