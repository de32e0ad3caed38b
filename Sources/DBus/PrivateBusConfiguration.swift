// The configuration of a private dbus-daemon for tests and the simulator: one socket, an allow-all policy and
// limits generous enough for notification bursts.

/// Configuration text for a private `dbus-daemon` (pass it with `--config-file`).
public enum DBusPrivateBusConfiguration {
    /// A system-type bus listening on the unix socket at `socketPath`, where anyone may own any name, send and
    /// receive anything, and eavesdrop; with raised limits (message size, queued bytes, pending replies, match rules)
    /// so that bursts of tens of thousands of signals are not dropped.
    public static func allowAll(socketPath: String) -> String {
        """
        <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
         "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
        <busconfig>
          <type>system</type>
          <listen>unix:path=\(socketPath)</listen>
          <auth>EXTERNAL</auth>
          <policy context="default">
            <allow user="*"/>
            <allow own="*"/>
            <allow send_type="method_call"/>
            <allow send_type="signal"/>
            <allow send_type="method_return"/>
            <allow send_type="error"/>
            <allow receive_type="method_call"/>
            <allow receive_type="signal"/>
            <allow receive_type="method_return"/>
            <allow receive_type="error"/>
            <allow send_destination="*" eavesdrop="true"/>
            <allow eavesdrop="true"/>
          </policy>
          <limit name="max_incoming_bytes">1000000000</limit>
          <limit name="max_outgoing_bytes">1000000000</limit>
          <limit name="max_message_size">134217728</limit>
          <limit name="max_replies_per_connection">50000</limit>
          <limit name="max_connections_per_user">10000</limit>
          <limit name="max_match_rules_per_connection">50000</limit>
        </busconfig>
        """
    }
}
