"""The report of scripts/estimate_memory.py as the text table it prints: the GPU peak and its breakdown, the
host plan, the state and communication bytes per rank, and the single changes that would make it fit."""

from __future__ import annotations

from common.ops.metrics import GIB


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def table(report: dict) -> str:
    largest = report["max_micro_batch_size"]
    state = report["state_bytes_per_rank"][0]
    rows = [
        ("recipe", report["recipe"]),
        ("world size / FSDP units", f"{report['world_size']} / {report['fsdp_units']}"),
        ("parameters (model)", f"{report['params']:,}"),
        *([("images per row", report["images_per_row"])] if report["images_per_row"] else []),
        ("peak per rank, GiB", f"{report['peak_gib_per_rank']:.2f} + {report['reserve_gib']} reserve"),
        *((f"  {name}, GiB", gib(report["breakdown_bytes"][name])) for name in report["breakdown_bytes"]),
        ("GPU memory, GiB", f"{report['gpu_memory_gib']}"),
        ("fits / headroom, GiB", f"{'yes' if report['fits'] else 'NO'} / {report['headroom_gib']:.2f}"),
        *host_rows(report["host"]),
        ("largest micro-batch that fits", "not measured (--quick)" if largest is None else largest),
        (
            "param / grad / optimizer bytes per rank",
            "{:,} / {:,} / {:,}".format(
                state["param_bytes"],
                state["optimizer_bytes"] // 2,
                state["optimizer_bytes"],
            ),
        ),
        (
            "all-gather / reduce-scatter bytes per step",
            "{:,} / {:,}".format(
                report["comm_bytes_per_step"]["all_gather_bytes"],
                report["comm_bytes_per_step"]["reduce_scatter_bytes"],
            ),
        ),
    ]
    for alternative in report.get("alternatives", []):
        if "error" in alternative:
            rows.append((f"with {alternative['change']}", alternative["error"]))
            continue
        verdict = "fits" if alternative["fits"] else "does not fit"
        rows.append((f"with {alternative['change']}", f"{alternative['peak_gib']:.2f} GiB, {verdict}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'':{width}} | estimate |", f"|{'-' * (width + 2)}|----------|"]
    return "\n".join(lines + [f"| {name:{width}} | {value} |" for name, value in rows])


def host_rows(host: dict) -> list[tuple[str, str]]:
    rank0, node = host["rank0_bytes"], host["node_bytes"]
    phases = f"  {' / '.join(rank0)}, GiB"
    return [
        ("host RAM per rank, GiB", f"{host['peak_gib_per_rank']:.2f} (with {host['reserve_gib']} reserve)"),
        (phases, " / ".join(gib(rank0[phase]) for phase in rank0)),
        (f"host RAM per node ({host['procs_per_node']} ranks), GiB", f"{host['peak_gib_per_node']:.2f}"),
        (phases, " / ".join(gib(node[phase]) for phase in node)),
    ]
