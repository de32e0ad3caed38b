// blebridge: wiring only; every subcommand lives in BridgeTools.
import BridgeTools

#if canImport(Glibc)
    import Glibc
#endif

let status = await BridgeCLI.main(Array(CommandLine.arguments.dropFirst()))
exit(status)
