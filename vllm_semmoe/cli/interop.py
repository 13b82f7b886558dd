"""Commands that meet other tools: ``import`` (vLLM / SGLang routing → trace), ``export``
(placement → SGLang / vLLM offline-EPLB files), ``report`` (HTML page with figures). No vLLM."""

from __future__ import annotations


from .output import add_json_argument, non_negative_int, positive_int, write_json


def cmd_import(args) -> int:
    from ..tools.interop import import_routing

    result = import_routing(args.paths, args.format, num_experts=args.num_experts, vocab_size=args.vocab_size,
                            prefill_only=args.prefill_only)
    result.trace.save(args.out)
    s = result.summary
    print(f"imported {s['format']} routing from {len(s['files'])} file(s): {s['requests']} requests, "
          f"{s['tokens']} tokens ({s['decode_tokens']} decode), {len(s['moe_layers'])} MoE layers of "
          f"{s['model_layers']} x {s['num_experts']} experts, top-{s['top_k']}; wrote {args.out}")
    if s["dense_layers_dropped"]:
        print(f"  layers without routed experts (dense), dropped: {s['dense_layers_dropped']}")
    if s.get("fragments"):
        print(f"  {s['fragments']} continuation segment(s) could not be tied to one request (SGLang's dump has "
              "no request ids) and were imported as requests of their own")
    if s.get("duplicate_records"):
        print(f"  {s['duplicate_records']} record(s) identical on several ranks kept once")
    if args.json:
        write_json(args.json, dict(s, out=args.out))
    return 0


def cmd_export(args) -> int:
    import numpy as np

    from ..tools.interop import export_placement, load_placement_file
    from ..core.placement import PlacementError
    from ..core.tables import load_tables

    placement = load_tables(args.tables).placement
    summary = export_placement(placement, args.format, args.out, dense_layers=args.dense_layers)
    back = load_placement_file(args.out, placement.ep_size, dense_layers=args.dense_layers,
                               num_experts=placement.num_experts)
    if summary["redundant_per_rank"] == 0:
        same = np.array_equal(back.placement().expert_device, placement.expert_device)
    else:  # every logical expert on exactly the ranks the placement gave it
        from ..tools.interop import expert_devices

        same = np.array_equal(back.expert_devices(), expert_devices(
            np.asarray(placement.physical_to_logical()), placement.ep_size, placement.num_experts))
    if not same:
        raise PlacementError(f"{args.out}: reloads to a different expert→device map (a bug; please report)")
    summary["roundtrip_ok"] = True
    print(f"exported {summary['method'] or 'the'} placement ({summary['moe_layers']} MoE layers x "
          f"{summary['num_experts']} experts, EP {summary['ep_size']}, {summary['redundant_per_rank']} redundant "
          f"slot(s) per rank, {summary['physical_slots']} physical slots) as {args.format} to {args.out}; "
          "reloads to the same expert→device map")
    if args.format == "sglang":
        print(f"  use: python -m sglang.launch_server ... --ep-size {summary['ep_size']} "
              f"--ep-num-redundant-experts {summary['redundant_per_rank'] * summary['ep_size']} "
              f"--init-expert-location {args.out}")
    else:
        print("  vLLM's offline-EPLB record is an open proposal (vLLM PR 41141), not yet in a vLLM release")
    if args.json:
        write_json(args.json, summary)
    return 0


def cmd_report(args) -> int:
    from ..evaluation.report import build_report

    result = build_report(args.from_dir, args.out)
    print(f"report: {result['html']} with {len(result['figures'])} figure(s)")
    for fig in result["figures"]:
        print(f"  {fig['file']}: {fig['title']}")
    for note in result["skipped"]:
        print(f"  skipped: {note}")
    if args.json:
        write_json(args.json, result)
    return 0


def add_parsers(sub) -> None:
    """Register ``import``, ``export`` and ``report``."""
    from ..tools.interop import EXPORT_FORMATS

    p = sub.add_parser("import", help="routing recorded by vLLM (routed experts) or SGLang (per_token dumps) → trace")
    p.add_argument("paths", nargs="+", help="vLLM: one file saved by vllm_semmoe.tools.interop.save_vllm_routed_experts; "
                                           "SGLang: expert_distribution_recorder_*.pt files or their directory")
    p.add_argument("--format", choices=("auto", "vllm", "sglang"), default="auto",
                   help="what the files are (default: detected from their content)")
    p.add_argument("--out", required=True, help="routing trace .npz to write")
    p.add_argument("--num-experts", type=positive_int, default=None,
                   help="routed experts per layer (default: SGLang's map, or vLLM's largest id + 1)")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="tokenizer vocabulary size (default: largest id + 1)")
    p.add_argument("--prefill-only", action="store_true", help="SGLang: skip decode passes")
    add_json_argument(p, "the import summary")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="a solved placement → SGLang --init-expert-location / vLLM offline-EPLB record")
    p.add_argument("--tables", required=True, help="tables directory written by `semmoe solve`")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="layout to write")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dense-layers", type=non_negative_int, default=0,
                   help="SGLang: leading model layers without experts (DeepSeek's first_k_dense_replace, "
                        "1 for DeepSeek-V2-Lite); they get the identity row")
    add_json_argument(p, "the export summary")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="an HTML page with figures from the JSON the other commands wrote")
    p.add_argument("--from", dest="from_dir", required=True,
                   help="directory with eval/analyze/bench JSON and tables directories (e.g. out/)")
    p.add_argument("--out", required=True, help="directory for index.html and its PNG figures")
    add_json_argument(p, "the list of figures")
    p.set_defaults(func=cmd_report)


__all__ = ["add_parsers", "cmd_export", "cmd_import", "cmd_report"]
