import MetricsHTTP
import Testing

/// The text exposition writer: layout, escaping, number formatting and the names it refuses.
@Suite struct PrometheusTextTests {
    @Test func groupsEachFamilyUnderOneHelpAndType() throws {
        var text = PrometheusText()
        try text.counter(name: "a_total", help: "A.", labels: ["error": "x"], value: 1)
        try text.gauge(name: "b", help: "B.", value: 2)
        try text.counter(name: "a_total", help: "A.", labels: ["error": "y"], value: 3)
        #expect(
            text.text == """
                # HELP a_total A.
                # TYPE a_total counter
                a_total{error="x"} 1
                a_total{error="y"} 3
                # HELP b B.
                # TYPE b gauge
                b 2

                """)
        #expect(text.bytes == Array(text.text.utf8))
        #expect(PrometheusText.contentType == "text/plain; version=0.0.4; charset=utf-8")
    }

    @Test func escapesLabelValuesAndHelp() throws {
        var text = PrometheusText()
        try text.gauge(
            name: "g", help: "back\\slash\nnew \"line\"", labels: ["z": "last", "a": "q\"b\\n\nl"], value: 1)
        let lines = text.text.split(separator: "\n", omittingEmptySubsequences: false)
        #expect(lines[0] == #"# HELP g back\\slash\nnew "line""#)
        #expect(lines[2] == #"g{a="q\"b\\n\nl",z="last"} 1"#)
        #expect(lines.count == 4 && lines[3].isEmpty)
        #expect(PrometheusText.escapeLabelValue("plain ünïcode") == "plain ünïcode")
    }

    @Test(arguments: [
        (Double.infinity, "+Inf"), (-Double.infinity, "-Inf"), (Double.nan, "NaN"), (0, "0"), (42, "42"),
        (-3, "-3"), (0.25, "0.25"), (1_764_626_400.25, "1764626400.25"), (1e20, "1e+20"), (1.5e-7, "1.5e-07"),
        (9_007_199_254_740_991, "9007199254740991"),
    ])
    func formatsValuesAsPrometheusDoes(value: Double, expected: String) {
        #expect(PrometheusText.format(value) == expected)
    }

    @Test func validatesNames() {
        for good in ["a", "_a", "a:b", "blebridge_reconnects_total", "A9_"] {
            #expect(PrometheusText.isValidMetricName(good), "\(good)")
        }
        for bad in ["", "9a", "a-b", "a b", "ä", "a.b", "a{b}"] {
            #expect(!PrometheusText.isValidMetricName(bad), "\(bad)")
        }
        #expect(PrometheusText.isValidLabelName("device"))
        #expect(!PrometheusText.isValidLabelName("a:b"))
        #expect(!PrometheusText.isValidLabelName("__name__"))
        #expect(!PrometheusText.isValidLabelName("1a"))
    }

    @Test func refusesWhatWouldMakeABadExposition() throws {
        var text = PrometheusText()
        #expect(throws: PrometheusTextError.invalidMetricName("bad-name")) {
            try text.gauge(name: "bad-name", help: "", value: 1)
        }
        #expect(throws: PrometheusTextError.invalidLabelName(metric: "m", label: "bad label")) {
            try text.gauge(name: "m", help: "", labels: ["bad label": "v"], value: 1)
        }
        #expect(throws: PrometheusTextError.negativeCounter(metric: "c_total", value: -1)) {
            try text.counter(name: "c_total", help: "", value: -1)
        }
        try text.counter(name: "c_total", help: "C.", labels: ["k": "v"], value: 1)
        #expect(throws: PrometheusTextError.typeConflict(metric: "c_total", existing: "counter", requested: "gauge")) {
            try text.gauge(name: "c_total", help: "C.", value: 1)
        }
        #expect(throws: PrometheusTextError.helpConflict(metric: "c_total")) {
            try text.counter(name: "c_total", help: "Other.", value: 1)
        }
        #expect(throws: PrometheusTextError.duplicateSample(metric: "c_total", labels: ["k": "v"])) {
            try text.counter(name: "c_total", help: "C.", labels: ["k": "v"], value: 2)
        }
        // Nothing refused made it into the output.
        #expect(text.text == "# HELP c_total C.\n# TYPE c_total counter\nc_total{k=\"v\"} 1\n")
        let message = PrometheusTextError.invalidMetricName("bad-name").description
        #expect(message.contains("bad-name") && message.contains("not valid"))
    }
}
