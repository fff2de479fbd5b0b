"""moekit.tune's table bookkeeping (the sweep itself needs a GPU)."""

import json

from moekit import tune


def test_each_tuned_bucket_is_merged_at_once_and_keeps_the_other_entries(tmp_path):
    # a sweep cut off by a time limit must keep what it finished: buckets merge one by one
    table = tmp_path / "experts_tuned.json"
    table.write_text(json.dumps({"gpu|bf16": {"E8_N64_K32": {"1": {"block_m": 16}, "64": {"block_m": 64}}}}))
    tune._merge_entry("gpu|bf16", "E8_N64_K32", "64", {"block_m": 128}, table)
    tune._merge_entry("gpu|mxfp4", "E8_N64_K32", "1", {"block_m": 16, "gemv": True}, table)
    merged = json.loads(table.read_text())
    assert merged["gpu|bf16"]["E8_N64_K32"] == {"1": {"block_m": 16}, "64": {"block_m": 128}}
    assert merged["gpu|mxfp4"]["E8_N64_K32"]["1"] == {"block_m": 16, "gemv": True}
