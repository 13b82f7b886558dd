from shared_fixtures import dev_trace, dev_trace_path, small_trace  # noqa: F401
