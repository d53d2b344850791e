"""Where findings go once the coordinator emits them: the terminal, JSON-lines files, the run report."""

from trainscout.sinks.console import ConsoleSink
from trainscout.sinks.jsonl import EventLog, JsonlSink
from trainscout.sinks.summary import write_summary

__all__ = ["ConsoleSink", "EventLog", "JsonlSink", "write_summary"]
