"""``--prompt-data`` on local Hugging Face datasets: ``save_to_disk`` directories (Dataset and DatasetDict) and
folders of parquet / arrow shards, sliced with ``@[a:b]`` over all their rows. The directories are written by
the real ``datasets`` library and pyarrow; slime-core reads them with pyarrow alone."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slimecore.config import Config
from slimecore.data.dataset import DataError, read_rows
from slimecore.data.source import PromptDataSource
from slimecore.hf_checkpoint import load_tokenizer

datasets = pytest.importorskip("datasets")

ROWS = [{"input": f"question {i}", "label": str(i), "metadata": {"i": i}} for i in range(12)]


@pytest.fixture
def saved(tmp_path):
    """A Dataset saved in 3 shards, so row order across shards is checked too."""
    path = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path), num_shards=3)
    return path


def _labels(rows):
    return [row["label"] for _, row in rows]


def test_save_to_disk_directory_reads_every_shard_in_order(saved):
    rows = read_rows(str(saved))
    assert _labels(rows) == [str(i) for i in range(12)]
    assert rows[0][1]["metadata"] == {"i": 0}
    assert rows[0][0].startswith(str(saved / "data-00000-of-00003.arrow"))
    assert rows[11][0].endswith("data-00002-of-00003.arrow, row 4")


@pytest.mark.parametrize("suffix,labels", [("@[2:5]", [2, 3, 4]), ("@[-3:]", [9, 10, 11]), ("@[3:9]", range(3, 9))])
def test_slices_cover_the_whole_directory(saved, suffix, labels):
    assert _labels(read_rows(str(saved) + suffix)) == [str(i) for i in labels]


def test_dataset_dict_needs_a_split_when_it_has_several(tmp_path):
    data = datasets.Dataset.from_list(ROWS)
    several = tmp_path / "dict"
    datasets.DatasetDict(train=data.select(range(8)), test=data.select(range(8, 12))).save_to_disk(str(several))
    with pytest.raises(DataError, match=r"splits train, test; point --prompt-data at one of them, e\.g\. .*dict/train"):
        read_rows(str(several))
    assert _labels(read_rows(str(several / "test"))) == ["8", "9", "10", "11"]
    single = tmp_path / "single"
    datasets.DatasetDict(train=data).save_to_disk(str(single))
    assert len(read_rows(str(single) + "@[:5]")) == 5


def test_parquet_shard_folder_as_a_dataset_repository_lays_it_out(tmp_path):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("a dataset card")
    pq.write_table(pa.Table.from_pylist(ROWS[6:]), repo / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:6]), repo / "data" / "train-00000-of-00002.parquet")
    assert _labels(read_rows(str(repo))) == [str(i) for i in range(12)]
    assert _labels(read_rows(str(repo) + "@[5:7]")) == ["5", "6"]


def test_arrow_file_format_folder(tmp_path):
    folder = tmp_path / "arrow"
    folder.mkdir()
    with pa.OSFile(str(folder / "part.arrow"), "wb") as sink:
        table = pa.Table.from_pylist(ROWS[:4])
        with pa.ipc.new_file(sink, table.schema) as writer:  # the IPC *file* format, not datasets' stream
            writer.write_table(table)
    assert _labels(read_rows(str(folder))) == ["0", "1", "2", "3"]


def test_a_directory_without_data_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("no data here")
    with pytest.raises(DataError, match="holds no dataset: no state.json / dataset_dict.json"):
        read_rows(str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"x\.parquet \(in the dataset directory .*\) cannot be read"):
        read_rows(str(broken))


def test_saved_dataset_feeds_the_data_source(saved, tiny_checkpoint):
    config = Config.make(prompt_data=str(saved) + "@[0:4]", label_key="label", n_samples_per_prompt=2)
    source = PromptDataSource.from_config(config, load_tokenizer(tiny_checkpoint))
    groups = source.get_samples(4)
    assert [g[0].label for g in groups] == ["0", "1", "2", "3"] and len(source) == 4
    assert groups[2][1].prompt == "question 2" and groups[2][1].metadata == {"i": 2}
