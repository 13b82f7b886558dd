"""Tools that drive engines and benchmarks: ``bench-serve`` (:mod:`.bench_serve`), ``bench-ep``
(:mod:`.bench_ep`), the profile → solve → serve workflows (:mod:`.workflows`, :mod:`.engine`,
:mod:`.profiling`), prompt sets (:mod:`.prompts`) and placement import/export (:mod:`.interop`)."""
