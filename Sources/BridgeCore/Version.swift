/// The program's version.
public enum BridgeVersion {
    /// The version string (`blebridge --version`, `bridge/info`, Home Assistant's `origin.sw`).
    public static let current = "0.2.0"
}
