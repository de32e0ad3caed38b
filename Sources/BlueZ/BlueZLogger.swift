// BlueZ logs through the shared `Logging` facility; these names keep the layer's earlier spelling.
@_exported import Logging

/// The logger the BlueZ layer takes (the shared `Logger`).
public typealias BlueZLogger = Logger
/// Log levels (the shared `LogLevel`).
public typealias BlueZLogLevel = LogLevel
/// Where log lines go (the shared `LogHandler`).
public typealias BlueZLogHandler = LogHandler
