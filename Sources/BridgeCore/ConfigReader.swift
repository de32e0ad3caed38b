// Reading the configuration tree: every value is checked where it is read, and every problem is recorded with its
// path (`devices[2].match.address: "AA:BB" is not a Bluetooth address`) so that one run reports all of them.
import GATT
import Logging
import YAML

/// One problem in the configuration: where, and what is wrong.
public struct ConfigError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The key path (`devices[2].match.address`).
    public var path: String
    /// What is wrong with it.
    public var reason: String

    /// A problem at `path`.
    public init(path: String, reason: String) {
        self.path = path
        self.reason = reason
    }

    /// `path: reason`.
    public var description: String { path.isEmpty ? reason : "\(path): \(reason)" }
}

/// Every problem found in one configuration.
public struct ConfigErrors: Error, Sendable, Equatable, CustomStringConvertible {
    /// The problems, in document order.
    public var errors: [ConfigError]
    /// Problems.
    public init(_ errors: [ConfigError]) { self.errors = errors }
    /// One line per problem.
    public var description: String { errors.map(\.description).joined(separator: "\n") }
}

/// Collects problems while the loader walks the tree.
final class ConfigProblems {
    var errors: [ConfigError] = []
    func add(_ path: String, _ reason: String) { errors.append(ConfigError(path: path, reason: reason)) }
}

/// A node being read, with its path; a mapping remembers which keys were read so unknown keys are reported.
struct ConfigNode {
    let node: YAMLNode
    let path: String
    let problems: ConfigProblems

    func child(_ key: String) -> String { path.isEmpty ? key : "\(path).\(key)" }

    /// Checks that this is a mapping whose keys are all in `allowed`; returns false (and records why) otherwise.
    @discardableResult
    func expectMapping(allowed: Set<String>) -> Bool {
        guard let entries = node.mapping else {
            if !node.isNull { problems.add(path, "expected a mapping, found \(node.kindDescription)") }
            return false
        }
        for (key, _) in entries where !allowed.contains(key) {
            let hint = closest(key, in: allowed).map { " (did you mean '\($0)'?)" } ?? ""
            problems.add(child(key), "unknown key\(hint); allowed here: \(allowed.sorted().joined(separator: ", "))")
        }
        return true
    }

    subscript(key: String) -> ConfigNode? {
        guard let value = node[key], !value.isNull else { return nil }
        return ConfigNode(node: value, path: child(key), problems: problems)
    }

    var items: [ConfigNode] {
        guard let seq = node.sequence else {
            problems.add(path, "expected a list, found \(node.kindDescription)")
            return []
        }
        return seq.enumerated().map { ConfigNode(node: $1, path: "\(path)[\($0)]", problems: problems) }
    }

    var string: String? {
        guard let s = node.scalar else {
            problems.add(path, "expected a string, found \(node.kindDescription)")
            return nil
        }
        return s
    }

    var bool: Bool? {
        guard let b = node.bool else {
            problems.add(path, "\(describe) is not true or false")
            return nil
        }
        return b
    }

    func integer(_ range: ClosedRange<Int>) -> Int? {
        guard let i = node.integer else {
            problems.add(path, "\(describe) is not an integer")
            return nil
        }
        guard range.contains(i) else {
            problems.add(path, "\(i) is out of range (\(range.lowerBound) to \(range.upperBound))")
            return nil
        }
        return i
    }

    func number(_ range: ClosedRange<Double>) -> Double? {
        guard let d = node.double, d.isFinite else {
            problems.add(path, "\(describe) is not a number")
            return nil
        }
        guard range.contains(d) else {
            problems.add(path, "\(d) is out of range (\(range.lowerBound) to \(range.upperBound))")
            return nil
        }
        return d
    }

    /// Seconds between `range` bounds, as a Duration.
    func seconds(_ range: ClosedRange<Double>) -> Duration? {
        number(range).map { .milliseconds(Int64(($0 * 1000).rounded())) }
    }

    func oneOf(_ choices: [String]) -> String? {
        guard let s = string else { return nil }
        guard choices.contains(s) else {
            problems.add(path, "\"\(s)\" is not one of \(choices.joined(separator: ", "))")
            return nil
        }
        return s
    }

    var uuid: BluetoothUUID? {
        guard let s = string else { return nil }
        guard let u = BluetoothUUID(s) else {
            problems.add(path, "\"\(s)\" is not a UUID (16-bit like \"180D\", or 128-bit)")
            return nil
        }
        return u
    }

    var address: BLEAddress? {
        guard let s = string else { return nil }
        guard let a = BLEAddress(s) else {
            problems.add(path, "\"\(s)\" is not a Bluetooth address (expected AA:BB:CC:DD:EE:FF)")
            return nil
        }
        return a
    }

    /// A string or a list of strings.
    var stringList: [String] {
        if node.sequence != nil { return items.compactMap(\.string) }
        return string.map { [$0] } ?? []
    }

    func fail(_ reason: String) { problems.add(path, reason) }

    var describe: String {
        if let s = node.scalar { return "\"\(s)\"" }
        return node.kindDescription
    }
}

/// The allowed key nearest to a misspelt one (edit distance ≤ 2).
func closest(_ key: String, in allowed: Set<String>) -> String? {
    func distance(_ a: [Character], _ b: [Character]) -> Int {
        if a.isEmpty { return b.count }
        if b.isEmpty { return a.count }
        var previous = Array(0...b.count)
        for i in 1...a.count {
            var current = [i] + Array(repeating: 0, count: b.count)
            for j in 1...b.count {
                current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1))
            }
            previous = current
        }
        return previous[b.count]
    }
    let k = Array(key)
    return allowed.map { ($0, distance(k, Array($0))) }.filter { $0.1 <= 2 }.min { $0.1 < $1.1 }?.0
}
