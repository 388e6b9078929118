"""The llama-server rows of the speculative benchmark: median round per mode against off's median."""
from goodput.bench.speculative import report_md, summarize_llama_rounds


def test_summary_takes_each_modes_median_round_against_offs_median_rate():
    rounds = {
        # off: rates 100, 90, 110 -> median 100
        "off": [{"rate": 100.0, "draft_tokens": 0, "accepted": 0, "ids": [[1, 2], [3, 4]]},
                {"rate": 90.0, "draft_tokens": 0, "accepted": 0, "ids": [[1, 2], [3, 4]]},
                {"rate": 110.0, "draft_tokens": 0, "accepted": 0, "ids": [[1, 2], [3, 4]]}],
        # spec: rates 150, 180, 120 -> median round is the 150 one: 150/100 = 1.5x, 30/40 = 0.75
        "spec": [{"rate": 150.0, "draft_tokens": 40, "accepted": 30, "ids": [[1, 2], [3, 5]]},
                 {"rate": 180.0, "draft_tokens": 10, "accepted": 10, "ids": [[1, 2], [3, 4]]},
                 {"rate": 120.0, "draft_tokens": 20, "accepted": 1, "ids": [[1, 2], [3, 4]]}],
    }
    s = summarize_llama_rounds(rounds)
    assert s["off"]["decode_tok_s"] == 100.0 and s["off"]["vs_off"] == 1.0
    assert s["off"]["acceptance_rate"] is None
    assert s["spec"]["decode_tok_s"] == 150.0
    assert s["spec"]["vs_off"] == 1.5
    assert s["spec"]["acceptance_rate"] == 0.75
    assert s["spec"]["identical_to_off"] == "1/2"  # the second prompt's output differs
    assert s["spec"]["rates"] == [150.0, 180.0, 120.0]


def test_report_has_only_the_llama_table_when_only_llama_rows_ran():
    rows = {"off": {"decode_tok_s": 100.0, "vs_off": 1.0, "acceptance_rate": None, "identical_to_off": "2/2"},
            "spec": {"decode_tok_s": 150.0, "vs_off": 1.5, "acceptance_rate": 0.75, "identical_to_off": "1/2"}}
    md = report_md({"llama_server": {"copying": rows}})
    assert "| copying | spec | 150.0 | 1.50x | 0.75 | 1/2 |" in md
    assert "| copying | off | 100.0 | 1.00x | - | 2/2 |" in md
    assert "tokens / step" not in md  # no in-process table
