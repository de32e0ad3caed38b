/// The built-in characteristic parsers (SPEC.md §3), as a literal list. The registry registers them in this order,
/// before any parser declared in the configuration.
public enum BuiltInCharacteristicParsers {
    /// Every built-in characteristic parser; no two share a UUID (the registry checks at start-up).
    public static let all: [any GATTCharacteristicParser] =
        [
            HeartRateMeasurementParser(),
            TemperatureMeasurementParser.measurement,
            TemperatureMeasurementParser.intermediate,
            CSCMeasurementParser(),
            RSCMeasurementParser(),
            CyclingPowerMeasurementParser(),
            WeightMeasurementParser(),
            BloodPressureParser.measurement,
            BloodPressureParser.intermediateCuffPressure,
            PLXSpotCheckParser(),
            PLXContinuousParser(),
            GlucoseMeasurementParser(),
            DateTimeParser(),
            CurrentTimeParser(),
            PnPIDParser(),
            AppearanceParser(),
            PresentationFormatDescriptorParser(),
        ]
        + ScalarCharacteristicParser.builtIn.map { $0 as any GATTCharacteristicParser }
        + ConcentrationCharacteristicParser.builtIn.map { $0 as any GATTCharacteristicParser }
        + StringCharacteristicParser.builtIn.map { $0 as any GATTCharacteristicParser }
}
