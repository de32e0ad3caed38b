// The tool subcommands, in the order `blebridge --help` lists them.
import BridgeKit

/// The command-line tools.
public enum BridgeToolCommands {
    /// decode, then the BlueZ tools: scan, explore, read, write, notify.
    public static let all: [any CLICommand.Type] = [
        DecodeCommand.self, ScanCommand.self, ExploreCommand.self, ReadCommand.self, WriteCommand.self,
        NotifyCommand.self,
    ]
}
