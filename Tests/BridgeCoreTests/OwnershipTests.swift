// The ownership rules of several gateways (docs/MULTI-GATEWAY.md), case by case with explicit time.
import BridgeCore
import Testing

@Suite struct OwnershipTests {
    let attic = OwnershipRules(me: "attic")
    let hall = OwnershipRules(me: "hall")
    let both: Set<String> = ["attic", "hall"]

    func sightings(attic a: Double?, hall h: Double?, at: Double = 100) -> [Sighting] {
        var out: [Sighting] = []
        if let a { out.append(Sighting(gateway: "attic", rssi: a, at: at)) }
        if let h { out.append(Sighting(gateway: "hall", rssi: h, at: at)) }
        return out
    }

    func claimant(_ action: OwnershipAction) -> String? {
        if case .claim(let c) = action { return c.owner }
        return nil
    }

    @Test func withoutAClaimTheGatewayThatHearsBestClaimsAndTheOtherWaits() {
        let s = sightings(attic: -60, hall: -75)
        #expect(
            claimant(attic.decide(claim: nil, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false))
                == "attic")
        #expect(
            hall.decide(claim: nil, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false) == .stayAway)
    }

    @Test func aGatewayWithoutAFreeSlotIsNoCandidate() {
        // attic hears it best but has no free connection slot: hall claims it, attic waits.
        let s = [
            Sighting(gateway: "attic", rssi: -60, at: 100, full: true), Sighting(gateway: "hall", rssi: -75, at: 100),
        ]
        let atticAction = attic.decide(
            claim: nil, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false)
        #expect(atticAction == .stayAway)
        #expect(
            claimant(hall.decide(claim: nil, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false))
                == "hall")
        // Nor does it take the device over by hearing it better for long enough.
        let held = DeviceClaim(owner: "hall", rssi: -75, expires: 230, since: 100)
        var later = [
            Sighting(gateway: "attic", rssi: -50, at: 200, full: true), Sighting(gateway: "hall", rssi: -75, at: 200),
        ]
        #expect(
            attic.decide(claim: held, sightings: later, online: both, now: 200, betterSince: 100, linkUp: false)
                == .stayAway)
        later[0].full = false
        let action = attic.decide(
            claim: held, sightings: later, online: both, now: 200, betterSince: 100, linkUp: false)
        #expect(claimant(action) == "attic", "with a free slot it would")
    }

    @Test func equalRSSIIsDecidedByTheSmallerGatewayID() {
        let s = sightings(attic: -70.02, hall: -69.98)  // equal to 0.1 dB
        #expect(
            claimant(attic.decide(claim: nil, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false))
                == "attic")
        #expect(
            hall.decide(claim: nil, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false) == .stayAway)
    }

    @Test func aValidClaimHoldsAgainstASlightlyBetterGateway() {
        let claim = DeviceClaim(owner: "hall", rssi: -70, expires: 120, since: 90)
        let s = sightings(attic: -65, hall: -70)  // 5 dB better: inside the 8 dB margin
        #expect(
            attic.decide(claim: claim, sightings: s, online: both, now: 100, betterSince: 0, linkUp: false) == .stayAway
        )
        #expect(!attic.hearsBetter(claim: claim, sightings: s, now: 100))
    }

    @Test func aMuchBetterGatewayTakesOverOnlyAfterTheHysteresis() {
        let claim = DeviceClaim(owner: "hall", rssi: -80, expires: 200, since: 90)
        let s = sightings(attic: -60, hall: -80)
        #expect(attic.hearsBetter(claim: claim, sightings: s, now: 100))
        // Better by 20 dB for 59 s: not yet.
        #expect(
            attic.decide(claim: claim, sightings: s, online: both, now: 159, betterSince: 100, linkUp: false)
                == .stayAway)
        // For 60 s: it claims.
        #expect(
            claimant(attic.decide(claim: claim, sightings: s, online: both, now: 160, betterSince: 100, linkUp: false))
                == "attic")
        // The owner, seeing the takeover claim after its own established one, yields.
        let takeover = DeviceClaim(owner: "attic", rssi: -60, expires: 190, since: 160)
        #expect(hall.mustYield(mine: claim, to: takeover, now: 160, online: both))
    }

    @Test func anOwnerWhoseWillFiredLosesItsClaimAtOnce() {
        let claim = DeviceClaim(owner: "hall", rssi: -60, expires: 200, since: 90)
        let s = sightings(attic: -75, hall: -60)
        #expect(
            attic.decide(claim: claim, sightings: s, online: both, now: 100, betterSince: nil, linkUp: false)
                == .stayAway)
        // hall's bridge/hall/state went offline (its MQTT will): its claim and sighting no longer count.
        #expect(
            claimant(
                attic.decide(claim: claim, sightings: s, online: ["attic"], now: 100, betterSince: nil, linkUp: false))
                == "attic")
    }

    @Test func aLapsedLeaseIsClaimedAgainByTheBest() {
        let claim = DeviceClaim(owner: "hall", rssi: -60, expires: 130, since: 90)
        let s = sightings(attic: -75, hall: -60, at: 125)
        #expect(
            attic.decide(claim: claim, sightings: s, online: both, now: 129, betterSince: nil, linkUp: false)
                == .stayAway)
        // Lapsed (hall stopped renewing): hall, still the best heard, claims anew; attic does not wait for a gateway
        // that failed to renew (it may be cut off) and claims too; the race goes to hall by RSSI.
        let hallAgain = hall.decide(claim: claim, sightings: s, online: both, now: 131, betterSince: nil, linkUp: false)
        let atticToo = attic.decide(claim: claim, sightings: s, online: both, now: 131, betterSince: nil, linkUp: false)
        #expect(claimant(hallAgain) == "hall" && claimant(atticToo) == "attic")
        if case .claim(let h) = hallAgain, case .claim(let a) = atticToo {
            #expect(attic.mustYield(mine: a, to: h, now: 131.2, online: both))
            #expect(!hall.mustYield(mine: h, to: a, now: 131.2, online: both))
        }
        // hall's sighting goes stale too: attic claims.
        #expect(
            claimant(
                attic.decide(
                    claim: claim, sightings: s + [Sighting(gateway: "attic", rssi: -75, at: 190)], online: both,
                    now: 190, betterSince: nil, linkUp: false)) == "attic")
    }

    @Test func aLostLinkIsTakenOverAfterTheGrace() {
        let lost = DeviceClaim(owner: "hall", rssi: -60, expires: 200, state: .linkLost, since: 100)
        let s = sightings(attic: -75, hall: -60, at: 120)
        #expect(
            attic.decide(claim: lost, sightings: s, online: both, now: 129, betterSince: nil, linkUp: false)
                == .stayAway)
        // After 30 s without the link, the claim no longer binds; hall still hears it best (advertisements), so
        // hall may claim again — but if hall no longer hears it, attic takes over.
        #expect(!attic.isValid(lost, now: 130, online: both))
        #expect(
            claimant(
                attic.decide(
                    claim: lost, sightings: sightings(attic: -75, hall: nil, at: 125), online: both, now: 131,
                    betterSince: nil, linkUp: false)) == "attic")
    }

    @Test func theOwnerRenewsAtAThirdOfTheLeaseAndReportsALostLink() {
        let claim = DeviceClaim(owner: "attic", rssi: -60, expires: 130, since: 100)
        let s = sightings(attic: -61, hall: -80)
        #expect(
            attic.decide(claim: claim, sightings: s, online: both, now: 105, betterSince: nil, linkUp: true)
                == .serve(renew: nil))
        guard
            case .serve(let renew?) = attic.decide(
                claim: claim, sightings: s, online: both, now: 110, betterSince: nil, linkUp: true)
        else {
            Issue.record("no renewal at a third of the lease")
            return
        }
        #expect(renew.expires == 140 && renew.state == .serving && renew.rssi == -61)
        // The link drops: reported at once, with when it began.
        guard
            case .serve(let lost?) = attic.decide(
                claim: claim, sightings: s, online: both, now: 106, betterSince: nil, linkUp: false)
        else {
            Issue.record("a lost link was not reported")
            return
        }
        #expect(lost.state == .linkLost && lost.since == 106)
    }

    @Test func twoClaimsInTheSameRoundResolveTheSameWayWhateverTheOrder() {
        let a = DeviceClaim(owner: "attic", rssi: -70, expires: 130, since: 100)
        let h = DeviceClaim(owner: "hall", rssi: -68, expires: 130, since: 100.2)
        #expect(attic.winner(a, h) == h && attic.winner(h, a) == h && hall.winner(a, h) == h)
        // Exactly one of them gives way.
        #expect(attic.mustYield(mine: a, to: h, now: 100.3, online: both))
        #expect(!hall.mustYield(mine: h, to: a, now: 100.3, online: both))
    }

    /// An owner cut off from the others (its broker bridge down) keeps renewing where only it sees; when it comes
    /// back, its older claim meets the one that took over meanwhile: the older yields, whatever the RSSI, so a
    /// returning gateway does not steal the device back.
    @Test func anOlderClaimReturningFromACutOffGatewayYields() {
        let stale = DeviceClaim(owner: "attic", rssi: -50, expires: 230, since: 100)
        let takeover = DeviceClaim(owner: "hall", rssi: -75, expires: 230, since: 160)
        #expect(attic.mustYield(mine: stale, to: takeover, now: 200, online: both))
        #expect(!hall.mustYield(mine: takeover, to: stale, now: 200, online: both))
    }

    /// An owner cut off behind a broker bridge still looks online and its sightings look fresh (both retained), but
    /// its lease lapses: the others do not wait for it.
    @Test func anOwnerWhoseLeaseLapsedIsNoCandidate() {
        let lapsed = DeviceClaim(owner: "attic", rssi: -50, expires: 130, since: 100)
        let action = hall.decide(
            claim: lapsed, sightings: sightings(attic: -50, hall: -80, at: 125), online: both, now: 131,
            betterSince: nil, linkUp: false)
        #expect(claimant(action) == "hall")
    }

    @Test func smoothingDampsOneOddAdvertisement() {
        var r = SmoothedRSSI(alpha: 0.2)
        for _ in 0..<20 { r.add(-70) }
        r.add(-40)
        #expect(abs((r.value ?? 0) - -64) < 0.01)
    }
}
